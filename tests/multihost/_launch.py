"""Start the ranks of a multi-host test on simulated hosts and collect what they
report: one process per rank (:func:`run_ranks`), or one torchrun agent per host
(:func:`run_torchrun`). Both are bounded: past ``timeout`` every process left is
killed and the test sees which ranks never reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.multihost._netns import Host, SimHosts

REPO = Path(__file__).resolve().parents[2]
MASTER_PORT = 29500
"""Free on every simulated host: each has its own ports."""
RDZV_PORT = 29400

# what the machine's environment may set that would change where ranks meet
_DROP = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
    "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "GLOO_SOCKET_IFNAME",
    "TP_SOCKET_IFNAME", "REMAT_DIST_CHANNEL_HOST", "PYTEST_XDIST_WORKER",
)  # fmt: skip


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _DROP and not k.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_"))
    }
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclass
class Outcome:
    """What the ranks reported (``reports[rank]``), their exit codes and logs."""

    reports: dict[int, dict[str, Any]]
    returncodes: dict[str, int | None]
    logs: dict[str, str]
    seconds: float
    timed_out: bool
    world_size: int

    def missing(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.reports]

    def describe(self) -> str:
        """Everything a failed assertion should show."""
        parts = [
            f"{self.seconds:.1f} s, timed out: {self.timed_out}, exit codes: {self.returncodes}"
        ]
        for r in range(self.world_size):
            rep = self.reports.get(r)
            if rep is None:
                parts.append(f"[rank {r}] no report")
            elif not rep.get("finished"):
                parts.append(
                    f"[rank {r}] on {rep.get('hostname')} (MASTER_ADDR {rep.get('master_addr')} -> "
                    f"{rep.get('master_addr_resolves_to')}) raised {rep.get('error_type')} after "
                    f"{rep.get('seconds', 0):.1f} s (runs completed before: "
                    f"{_completed(rep.get('result', {}))}):\n"
                    f"{rep.get('traceback', '')[-1500:]}"
                )
        for name, text in self.logs.items():
            parts.append(f"--- log {name} (last 2000 chars) ---\n{text[-2000:]}")
        return "\n".join(parts)


def _completed(result: dict[str, Any]) -> dict[str, list[str]]:
    """The runs each part of a scenario's result says it completed."""
    out = {"": result["completed"]} if "completed" in result else {}
    for key, part in result.items():
        if isinstance(part, dict) and "completed" in part:
            out[key] = part["completed"]
    return out


def _collect(out_dir: Path, world_size: int) -> dict[int, dict[str, Any]]:
    reports = {}
    for r in range(world_size):
        path = out_dir / f"rank{r}.json"
        if path.exists():
            reports[r] = json.loads(path.read_text())
    return reports


def _wait_all(
    hosts: SimHosts, procs: dict[str, subprocess.Popen], deadline: float
) -> bool:
    """Wait for every process until ``deadline``; kill what is left. True when
    something had to be killed."""
    timed_out = False
    for proc in procs.values():
        left = deadline - time.monotonic()
        try:
            proc.wait(timeout=max(0.01, left))
        except subprocess.TimeoutExpired:
            timed_out = True
    for proc in procs.values():
        if proc.poll() is None:
            hosts.stop(proc, grace=2.0)
    return timed_out


def run_ranks(
    hosts: SimHosts,
    scenario: str,
    placement: Sequence[int],
    *,
    master: str,
    out_dir: Path,
    opts: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
    gloo_ifname: bool = True,
) -> Outcome:
    """Rank ``r`` runs the scenario on host ``placement[r]``, its environment what
    a launcher gives a rank: ``MASTER_ADDR=master`` (an address or a node name,
    resolved on each host by that host's hosts file), ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, and ``GLOO_SOCKET_IFNAME`` (the host's
    interface; ``gloo_ifname=False`` leaves it unset)."""
    world = len(placement)
    out_dir.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    local_counts: dict[int, int] = {}
    t0 = time.monotonic()
    for r, k in enumerate(placement):
        host: Host = hosts[k]
        local = local_counts.get(k, 0)
        local_counts[k] = local + 1
        env = base_env(
            {
                "MASTER_ADDR": master,
                "MASTER_PORT": str(MASTER_PORT),
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(local),
            }
        )
        if gloo_ifname:
            env["GLOO_SOCKET_IFNAME"] = host.ifname
        name = f"rank{r}@{host.name}"
        logs[name] = out_dir / f"{name}.log"
        with open(logs[name], "wb") as log:
            procs[name] = hosts.popen(
                host,
                [sys.executable, "-m", "tests.multihost._worker", scenario, str(out_dir),
                 json.dumps(dict(opts or {}))],
                env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
    return _outcome(hosts, procs, logs, out_dir, world, t0, timeout)


def _is_host(hosts: SimHosts, host: Host, endpoint: str) -> list[str]:
    """torchrun's c10d rendezvous serves its store on the agent whose host name
    or name's addresses match the endpoint; an endpoint given as an address of
    another interface than the one the host name resolves to (here: always, the
    name being 127.0.1.1) matches no agent, and every agent waits as a client.
    A cluster user then says which agent hosts it, as here."""
    if endpoint in {h.name for h in hosts.hosts}:
        return []
    return ["--rdzv-conf", f"is_host={int(endpoint == host.addr)}"]


def run_torchrun(
    hosts: SimHosts,
    scenario: str,
    *,
    endpoint: str,
    out_dir: Path,
    nproc_per_node: int = 1,
    opts: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
    local_addr: bool = False,
) -> Outcome:
    """One torchrun agent per host (``--nnodes len(hosts)``, c10d rendezvous at
    ``endpoint:RDZV_PORT``), each with ``GLOO_SOCKET_IFNAME`` set to its host's
    interface as a cluster user's job script sets it. The agents give their
    workers ``MASTER_ADDR`` themselves: the host name of the agent that became
    rank 0 of the rendezvous (``local_addr=True``: each agent is given its
    host's address with ``--local-addr``, and hands that instead)."""
    world = len(hosts) * nproc_per_node
    out_dir.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    t0 = time.monotonic()
    for host in hosts.hosts:
        env = base_env({"GLOO_SOCKET_IFNAME": host.ifname})
        name = f"agent@{host.name}"
        logs[name] = out_dir / f"{name}.log"
        argv = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(len(hosts)), "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{endpoint}:{RDZV_PORT}",
            "--rdzv-id", f"rd-{hosts.tag}", "--max-restarts", "0",
            "--monitor-interval", "0.5",
            *(["--local-addr", host.addr] if local_addr else []),
            *_is_host(hosts, host, endpoint),
            "-m", "tests.multihost._worker", scenario, str(out_dir),
            json.dumps(dict(opts or {})),
        ]  # fmt: skip
        with open(logs[name], "wb") as log:
            procs[name] = hosts.popen(
                host, argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )
    return _outcome(hosts, procs, logs, out_dir, world, t0, timeout)


def _outcome(hosts, procs, logs, out_dir, world: int, t0: float, timeout: float) -> Outcome:
    """Wait for every process (bounded), then what they reported."""
    timed_out = _wait_all(hosts, procs, t0 + timeout)
    return Outcome(
        reports=_collect(out_dir, world),
        returncodes={n: p.returncode for n, p in procs.items()},
        logs={n: p.read_text(errors="replace") for n, p in logs.items()},
        seconds=time.monotonic() - t0,
        timed_out=timed_out,
        world_size=world,
    )
