"""``python -m remat_dist bench --scale``: the step agreement's store traffic at scale,
simulated on one machine.

What is simulated. Every training step, each rank hashes the plan of every checkpoint
it ran in forward (what ``StepAgreement.add_checkpoint`` does), then takes part in
two store rounds (``remat_dist.distributed._store_round.StoreRound``): one
``exchange`` of the step's short plan value (built as ``StepAgreement._value``
builds it, judged by the real ``_plans_differ``) and, at backward's end, one
``report(None)``. For comparison, the previous design ran two rounds per checkpoint
per step (simulated as two ``exchange`` rounds of a short value per checkpoint).

How. One real ``torch.distributed.TCPStore`` server listens on 127.0.0.1 in the
benchmark process. Simulated ranks are its clients: each rank has its own
``TCPStore`` client connection (made once, when the worker starts), wrapped in a
``PrefixStore`` with a fresh prefix per configuration, and runs the real
``StoreRound`` code in its own thread. The threads live in a few worker processes
(``forkserver``), so that 1,024 ranks fit on a small machine: a thread blocked in a
store call is inside C++ and has released the GIL. Each configuration runs one
warm-up round pair (so the rounds' key deletions are in their steady state), then
the measured steps; the plan hashing is done before them, outside the timing (real
ranks hash in parallel on their own CPUs; here they would queue for one GIL).

Figures per configuration (medians/means over the measured steps):

* ``wall_ms_per_step``: from the first rank entering the step's first round to the
  last rank leaving its last round (clocks are ``time.monotonic``, system-wide);
* ``requests_per_rank_mean`` / ``_max``: store requests per rank per step as
  ``StoreRound.requests`` counts them (one per store call; the TCPStore client
  itself sends an extra ``wait`` before every ``get``/``multi_get``);
* ``server_requests_per_step``: their sum over ranks; ``server_requests_per_s``:
  that divided by the wall time;
* ``server_cpu_share`` (extra): CPU time of the benchmark process, which does
  nothing but serve the store, over the configuration's wall time (warm-up and
  thread start included): near 1.0 (one core) the server is the bottleneck;
* ``estimated``: the row was not run (it would exceed the time budget) but scaled
  linearly in the number of rounds from a measured row (``basis`` says which).

What it does not capture: the network latency between hosts (every request here is
a loopback round trip of some tens of microseconds, not a datacenter one), a real
TCPStore server on its own host (here it shares the machine's few cores with every
client thread, so wall times at many ranks mostly measure the clients' Python on
these cores, not the server), and the ranks' own training work around the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any

from remat_dist.distributed._step import _plans_differ
from remat_dist.distributed._store_round import StoreRound

__all__ = ["ScaleConfig", "format_scale_table", "main", "run_scale"]

HOST = "127.0.0.1"
RESOLVER_NOISE = "hostname of the client socket cannot be retrieved"
STEP = "step"
PER_CHECKPOINT = "per-checkpoint"
ROW_KEYS = (
    "ranks",
    "checkpoints",
    "design",
    "wall_ms_per_step",
    "requests_per_rank_mean",
    "requests_per_rank_max",
    "server_requests_per_step",
    "estimated",
)
"""The documented keys of every JSON row (rows carry a few more)."""


@dataclass
class ScaleConfig:
    """What the scale simulation runs, and its time bounds."""

    ranks: tuple[int, ...] = (8, 64, 256, 1024)
    """Simulated ranks per configuration."""
    checkpoints: tuple[int, ...] = (8, 64)
    """Checkpoints per step."""
    steps: int = 5
    """Measured steps of the per-step design (after one warm-up round pair)."""
    old_steps: int = 1
    """Measured steps of the per-checkpoint design, where affordable."""
    workers: int = 4
    """Worker processes the simulated ranks are spread over (threads in each)."""
    timeout: float = 30.0
    """Bound (seconds) of every store round and store connection."""
    old_budget_s: float = 25.0
    """Largest predicted time for one per-checkpoint configuration; beyond it the
    row is estimated."""
    budget_s: float = 210.0
    """Per-checkpoint runs stop (rows estimated) once the whole run would exceed it."""
    job_limit_s: float = 90.0
    """Ranks stop between rounds once a configuration has run this long."""

    @classmethod
    def quick(cls) -> ScaleConfig:
        return cls(steps=2, old_budget_s=3.0, budget_s=25.0, job_limit_s=20.0)


# -- one simulated rank


@dataclass(frozen=True)
class Job:
    """One configuration, as sent to every worker."""

    prefix: str
    ranks: int
    checkpoints: int
    design: str
    steps: int
    timeout: float
    stop_at: float
    """``time.monotonic()`` past which ranks stop between rounds."""


@dataclass
class RankResult:
    """One simulated rank's measurements of one configuration."""

    rank: int
    enter: list[float] = field(default_factory=list)
    leave: list[float] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    hash_s: list[float] = field(default_factory=list)
    error: str | None = None


class PlanHash:
    """The plan digest of one step as ``StepAgreement.add_checkpoint`` and
    ``StepAgreement._value`` compute it, without a process group."""

    def __init__(self) -> None:
        self.plan = hashlib.sha256()
        self.groups: dict[str, Any] = {}
        self.count = 0

    def add(self, entry: list[Any], group_fps: dict[str, str]) -> None:
        self.plan.update(json.dumps(entry, separators=(",", ":")).encode())
        for key, fp in group_fps.items():
            h = self.groups.setdefault(key, hashlib.sha256())
            h.update(f"{self.count}:{fp}\n".encode())
        self.count += 1

    def value(self) -> str:
        groups = {k: h.hexdigest()[:16] for k, h in sorted(self.groups.items())}
        plan = f"{self.plan.hexdigest()[:16]}:{self.count}"
        return json.dumps({"p": plan, "g": groups}, separators=(",", ":"))


def _plan_entry(i: int) -> list[Any]:
    regions = [["attention", "recompute", "replay"], ["mlp", "recompute", "replay"]]
    return [f"layers.{i}", "replay", regions]


def _group_fps(i: int, rank: int, ranks: int) -> dict[str, str]:
    """A tensor-parallel group of 8 (or all ranks) and the world, as a model
    sharded both ways records them; equal among each group's ranks."""
    tp = 8 if ranks % 8 == 0 else ranks
    fp = hashlib.sha256(f"collectives of checkpoint {i}".encode()).hexdigest()[:16]
    return {f"tp{rank // tp}/{tp}": f"{fp}:2", f"world/{ranks}": f"{fp}:1"}


def _step_values(job: Job, rank: int) -> tuple[list[str], float]:
    """One step's values to post (per-step design: one; per-checkpoint design: one
    per checkpoint, each posted twice) and the thread time spent hashing them."""
    t0 = time.thread_time()
    plan = PlanHash()
    values = []
    for i in range(job.checkpoints):
        entry = _plan_entry(i)
        plan.add(entry, _group_fps(i, rank, job.ranks))
        values.append(f"{plan.plan.hexdigest()[:16]}:{i}")
    if job.design == STEP:
        values = [plan.value()]
    return values, time.thread_time() - t0


def _agreed(verdict: dict[int, str] | None, what: str) -> None:
    if verdict is not None:
        ranks = sorted(verdict)[:8]
        raise RuntimeError(f"{what}: the ranks' values differed: {ranks}")


def _run_step(rnd: StoreRound, job: Job, values: list[str]) -> None:
    if job.design == STEP:
        verdict = rnd.exchange(values[0], timeout=job.timeout, judge=_plans_differ)
        _agreed(verdict, "exchange")
        _agreed(rnd.report(None, timeout=job.timeout), "report")
        return
    for value in values:
        for _ in range(2):
            _agreed(rnd.exchange(value, timeout=job.timeout), "per-checkpoint round")


def _warm_up(rnd: StoreRound, job: Job) -> None:
    """One round pair, so that the measured rounds delete keys as a long run does."""
    if job.design == STEP:
        values, _ = _step_values(job, rnd.rank)
        _run_step(rnd, job, values)
    else:
        _run_step(rnd, job, ["warm-up"])


def simulate_rank(store: Any, job: Job, rank: int) -> RankResult:
    """Run ``job`` as rank ``rank`` on ``store`` (this rank's own client)."""
    import torch.distributed as dist

    out = RankResult(rank)
    try:
        prefixed = dist.PrefixStore(job.prefix, store)
        rnd = StoreRound(prefixed, tuple(range(job.ranks)), rank)
        steps = [_step_values(job, rank) for _ in range(job.steps)]
        _warm_up(rnd, job)
        for values, hash_s in steps:
            if time.monotonic() > job.stop_at:
                raise TimeoutError("the configuration's time limit was reached")
            before, t0 = rnd.requests, time.monotonic()
            _run_step(rnd, job, values)
            out.leave.append(time.monotonic())
            out.enter.append(t0)
            out.requests.append(rnd.requests - before)
            out.hash_s.append(hash_s)
    except Exception as e:  # reported per rank, never raised in a thread
        out.error = f"{type(e).__name__}: {e}"
    return out


# -- a worker process: many simulated ranks, one thread each


def _connect(port: int, ranks: list[int], timeout: float) -> dict[int, Any]:
    """One client per rank, made in parallel: a connection can stall for seconds
    where the resolver is slow (c10d looks up the peer's host name for its logs)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    wait = timedelta(seconds=timeout)

    def client(rank: int) -> Any:
        return dist.TCPStore(HOST, port, is_master=False, timeout=wait)

    threads = max(1, min(64, len(ranks)))
    with _stderr_without(RESOLVER_NOISE), ThreadPoolExecutor(threads) as pool:
        return dict(zip(ranks, pool.map(client, ranks), strict=True))


@contextlib.contextmanager
def _stderr_without(noise: str) -> Iterator[None]:
    """This process's stderr (C++ logs included) minus the lines holding ``noise``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if noise not in line))


def _run_job(job: Job, stores: dict[int, Any]) -> list[RankResult]:
    results: dict[int, RankResult] = {}
    mine = [r for r in stores if r < job.ranks]

    def run(rank: int) -> None:
        results[rank] = simulate_rank(stores[rank], job, rank)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in mine]
    for t in threads:
        t.start()
    end = job.stop_at + 2 * job.timeout + 5
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    late = "did not finish in time"
    return [results.get(r) or RankResult(r, error=late) for r in mine]


def _worker(conn: Any, port: int, ranks: list[int], timeout: float) -> None:
    """Entry point of a worker process: connect its ranks, then run jobs until told
    to stop (None) or the benchmark process is gone."""
    try:
        stores = _connect(port, ranks, timeout)
        conn.send("ready")
        parent = multiprocessing.parent_process()
        while True:
            if not conn.poll(1.0):
                if parent is not None and not parent.is_alive():
                    return
                continue
            job = conn.recv()
            if job is None:
                return
            conn.send(_run_job(job, stores))
    except (EOFError, BrokenPipeError):
        return
    except Exception as e:
        conn.send(f"{type(e).__name__}: {e}")
    finally:
        conn.close()


class _Workers:
    """The worker processes; rank ``r`` lives in worker ``r % workers``."""

    def __init__(self, workers: int, ranks: int, port: int, timeout: float) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for w in range(min(workers, ranks)):
            here, there = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(there, port, list(range(w, ranks, workers)), timeout),
                daemon=True,
            )
            p.start()
            there.close()
            self.conns.append(here)
            self.procs.append(p)
        try:
            for reply in self._replies(time.monotonic() + 60 + timeout):
                if reply != "ready":
                    raise RuntimeError(f"a worker could not start: {reply}")
        except BaseException:
            self.close()
            raise

    def _replies(self, deadline: float) -> list[Any]:
        out = []
        for conn in self.conns:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError("a worker process did not answer in time")
            out.append(conn.recv())
        return out

    def run(self, job: Job) -> list[RankResult]:
        for conn in self.conns:
            conn.send(job)
        replies = self._replies(job.stop_at + 3 * job.timeout + 10)
        bad = [r for r in replies if not isinstance(r, list)]
        if bad:
            raise RuntimeError(f"a worker failed: {bad[0]}")
        return sorted((r for rs in replies for r in rs), key=lambda r: r.rank)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.conns:
            conn.close()


# -- configurations, rows, estimates


def _row(job: Job, results: list[RankResult]) -> dict[str, Any]:
    """The documented figures of one measured configuration."""
    errors = [r.error for r in results if r.error]
    done = min(len(r.requests) for r in results)
    row: dict[str, Any] = {
        "ranks": job.ranks,
        "checkpoints": job.checkpoints,
        "design": job.design,
        "estimated": False,
        "steps": done,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }
    if not done:
        return {**row, **dict.fromkeys(ROW_KEYS[3:7]), "server_requests_per_s": None}
    walls = [
        max(r.leave[s] for r in results) - min(r.enter[s] for r in results)
        for s in range(done)
    ]
    per_rank = [r.requests[s] for r in results for s in range(done)]
    server = statistics.mean(sum(r.requests[s] for r in results) for s in range(done))
    wall = statistics.median(walls)
    spans = [r.leave[s] - r.enter[s] for r in results for s in range(done)]
    return {
        **row,
        "wall_ms_per_step": wall * 1e3,
        "requests_per_rank_mean": statistics.mean(per_rank),
        "requests_per_rank_max": max(per_rank),
        "server_requests_per_step": server,
        "server_requests_per_s": server / wall if wall > 0 else None,
        "rank_ms_per_step_median": statistics.median(spans) * 1e3,
        "hash_us_per_rank_step": statistics.median(
            h for r in results for h in r.hash_s[:done]
        ) * 1e6,
    }


def _estimate(
    basis: dict[str, Any], checkpoints: int, factor: float
) -> dict[str, Any]:
    """A per-checkpoint row not run: ``basis`` scaled by ``factor`` (its ratio of
    rounds per step); the server's request rate is taken as the basis's."""
    row = {
        **basis,
        "checkpoints": checkpoints,
        "design": PER_CHECKPOINT,
        "estimated": True,
        "steps": 0,
        "basis": f"{basis['design']} C={basis['checkpoints']} x{factor:g}",
    }
    for key in ("wall_ms_per_step", "requests_per_rank_mean", "requests_per_rank_max",
                "server_requests_per_step", "rank_ms_per_step_median"):
        if basis.get(key) is not None:
            row[key] = basis[key] * factor
    row.pop("hash_us_per_rank_step", None)
    row["server_cpu_share"] = None
    return row


def _rounds_per_step(design: str, checkpoints: int) -> int:
    return 2 if design == STEP else 2 * checkpoints


def _per_round_s(row: dict[str, Any]) -> float:
    rounds = _rounds_per_step(row["design"], row["checkpoints"])
    return (row["wall_ms_per_step"] or 0.0) / 1e3 / rounds


class _Runner:
    """Runs configurations on the workers within the time budget."""

    def __init__(
        self, cfg: ScaleConfig, workers: _Workers, progress: Callable[[str], None]
    ) -> None:
        self.cfg = cfg
        self.workers = workers
        self.progress = progress
        self.start = time.monotonic()
        self.run_id = uuid.uuid4().hex[:8]

    def measure(
        self, ranks: int, checkpoints: int, design: str, steps: int
    ) -> dict[str, Any]:
        job = Job(
            prefix=f"bench_scale/{self.run_id}/{ranks}/{checkpoints}/{design}",
            ranks=ranks,
            checkpoints=checkpoints,
            design=design,
            steps=steps,
            timeout=self.cfg.timeout,
            stop_at=time.monotonic() + self.cfg.job_limit_s,
        )
        t0, cpu0 = time.monotonic(), time.process_time()
        row = _row(job, self.workers.run(job))
        took = time.monotonic() - t0
        row["server_cpu_share"] = (time.process_time() - cpu0) / took
        self.progress(
            f"  N={ranks:<5} C={checkpoints:<3} {design:<15} {took:6.1f} s  "
            f"server CPU {row['server_cpu_share']:4.0%}  errors={row['errors']}"
        )
        return row

    def per_checkpoint(
        self, ranks: int, checkpoints: int, basis: dict[str, Any]
    ) -> dict[str, Any]:
        """Measured where the prediction from ``basis`` fits the budgets, else
        estimated from it."""
        cfg = self.cfg
        rounds = _rounds_per_step(PER_CHECKPOINT, checkpoints)
        predicted = _per_round_s(basis) * (2 + rounds * cfg.old_steps)  # + warm-up
        elapsed = time.monotonic() - self.start
        if predicted <= cfg.old_budget_s and elapsed + predicted <= cfg.budget_s:
            return self.measure(ranks, checkpoints, PER_CHECKPOINT, cfg.old_steps)
        factor = rounds / _rounds_per_step(basis["design"], basis["checkpoints"])
        return _estimate(basis, checkpoints, factor)

    def ranks_rows(self, ranks: int) -> list[dict[str, Any]]:
        cps = sorted(self.cfg.checkpoints)
        rows = [self.measure(ranks, c, STEP, self.cfg.steps) for c in cps]
        basis = rows[0]
        for c in cps:
            row = self.per_checkpoint(ranks, c, basis)
            if not row["estimated"] and row["steps"]:
                basis = row
            rows.append(row)
        return rows


def _raise_fd_limit(ranks: int) -> None:
    """The server holds one socket per simulated rank."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = ranks + 256
        if soft < want and (hard == resource.RLIM_INFINITY or hard >= want):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


def _server(timeout: float) -> Any:
    """The TCPStore server on a free port, listening on an IPv4 socket made here
    (its default IPv6 one sees 127.0.0.1 as ``::ffff:127.0.0.1``, a name that
    /etc/hosts does not hold: accepting a client then waits on DNS)."""
    import socket

    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((HOST, 0))
    listener.listen(4096)
    port = listener.getsockname()[1]
    return dist.TCPStore(
        HOST, port, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=timeout), master_listen_fd=listener.detach(),
    )


def machine() -> dict[str, Any]:
    return {
        "arch": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "system": platform.system(),
    }


def run_scale(
    cfg: ScaleConfig, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run every configuration of ``cfg``; the JSON document (rows in order)."""
    import torch

    progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    most = max(cfg.ranks)
    _raise_fd_limit(most)
    server = _server(cfg.timeout)
    progress(f"scale simulation: TCPStore on {HOST}:{server.port}, "
             f"{most} simulated ranks over {min(cfg.workers, most)} worker processes")
    workers = _Workers(cfg.workers, most, server.port, cfg.timeout)
    try:
        runner = _Runner(cfg, workers, progress)
        rows = [row for n in sorted(cfg.ranks) for row in runner.ranks_rows(n)]
    finally:
        workers.close()
        del server
    return {
        "machine": machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": asdict(cfg),
        "wall": "first rank entering the step's first round to last rank leaving "
                "its last round; median over measured steps",
        "rows": rows,
    }


# -- output


_COLUMNS = (
    # header, row key, width, format
    ("wall ms/step", "wall_ms_per_step", 12, ".1f"),
    ("req/rank mean", "requests_per_rank_mean", 13, ".2f"),
    ("max", "requests_per_rank_max", 5, ".0f"),
    ("server req/step", "server_requests_per_step", 15, ".0f"),
    ("server req/s", "server_requests_per_s", 12, ".0f"),
    ("srv CPU", "server_cpu_share", 7, ".0%"),
)


def _cell(x: float | None, width: int, fmt: str) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}{fmt}}"


def format_scale_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table; estimated rows are marked ``~`` after the design."""
    head = f"{'ranks':>5} {'ckpts':>5}  {'design':<16}" + "".join(
        f" {name:>{width}}" for name, _, width, _ in _COLUMNS
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        design = r["design"] + (" ~" if r["estimated"] else "")
        cells = "".join(
            f" {_cell(r.get(key), width, fmt)}" for _, key, width, fmt in _COLUMNS
        )
        errors = f"  ERRORS {r['errors']}: {r['first_error']}" if r["errors"] else ""
        first = f"{r['ranks']:>5} {r['checkpoints']:>5}  {design:<16}"
        lines.append(first + cells + errors)
    lines += [
        "wall: first rank entering the step's first round to last rank leaving its "
        "last (median over steps)",
        "srv CPU: the server process's CPU time over the configuration's wall time "
        "(one core = 100%)",
        "~: estimated (not run), scaled from the row named in the JSON 'basis'",
    ]
    return "\n".join(lines)


def _config(args: argparse.Namespace) -> ScaleConfig:
    cfg = ScaleConfig.quick() if args.quick else ScaleConfig()
    changes = {
        "ranks": tuple(args.ranks) if args.ranks else None,
        "checkpoints": tuple(args.checkpoints) if args.checkpoints else None,
        "steps": args.steps,
        "workers": args.workers,
        "timeout": args.timeout,
        "budget_s": args.budget,
    }
    return replace(cfg, **{k: v for k, v in changes.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    """Run the simulation, print its table, write its JSON; 1 if any simulated rank
    saw an error."""
    parser = argparse.ArgumentParser(
        prog="python -m remat_dist bench --scale",
        description="The step agreement's store traffic with up to 1,024 simulated "
        "ranks against one real TCPStore, and the per-checkpoint design it replaced.",
    )
    parser.add_argument("--json", default="bench_scale.json", help="write it here")
    parser.add_argument("--quick", action="store_true", help="fewer steps, less budget")
    parser.add_argument("--ranks", type=int, nargs="+", help="simulated ranks to run")
    parser.add_argument("--checkpoints", type=int, nargs="+", help="per step")
    parser.add_argument("--steps", type=int, help="measured steps (per-step design)")
    parser.add_argument("--workers", type=int, help="worker processes")
    parser.add_argument("--timeout", type=float, help="bound of each store round (s)")
    parser.add_argument("--budget", type=float, help="time budget of the run (s)")
    args = parser.parse_args(argv)
    result = run_scale(_config(args))
    print(format_scale_table(result["rows"]))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")
    return 1 if any(r["errors"] for r in result["rows"]) else 0
