"""``python -m benchmarks.scale``: what the per-step agreement costs at scale,
simulated on one machine.

What is simulated. Each step, every rank at stake runs what the library runs: one
agreement (``StakeGroup.reduce_max`` of its tagged plan digest, built as
``PlanDigest.words`` builds it: 6 int64) and one report (6 int64), among the ranks
of its stake (a tensor-parallel group of ``group`` ranks), on a real
``StakeGroup``: a gloo group of the stake's ranks over loopback, set up through
the store.

Not simulated any more: the world-wide store rounds (``StoreRound``, one exchange
and one report of every rank through the one store server) that the side channel
replaced; their code is gone with the side channel (commit 3195571), and their
measured figures stay in docs/benchmarks.md as history (a TP=8 stake's rounds
then took 0.35 / 0.72 ms on the side channel; the world store's server took 8,196
requests per step at 1,024 ranks).

How. One ``TCPStore`` server listens in the benchmark process (the groups use it
for their set-up only). Simulated ranks are threads spread over a few worker
processes (``forkserver``), rank ``r`` in worker ``r % workers``, so that the ranks
of one stake sit in different processes, each with its own store client. A
configuration runs one warm-up step (set-up included), then the measured steps.

Figures per configuration (medians over the measured steps):

* ``agreement_ms``: per stake and step, from the last member entering the
  agreement to the last leaving it (its latency once everyone is there), median
  over stakes and steps; ``critical_ms``: the same over the step's two rounds (the
  agreement and the report);
* ``operations_per_rank`` (mean, max): gloo operations a rank issues per step
  (one per round);
* ``server_requests_per_step``: store requests per step at the server, steady
  state; ``setup_requests``: the groups' own requests at their set-up (gloo's
  rendezvous inside ``ProcessGroupGloo`` not counted);
* ``modelled`` rows are not run: 16,384 ranks as PP=16 x DP=128 x TP=8 take the
  measured row of the same stake size (stakes share nothing: no server, no link,
  so their latency does not depend on how many there are), and a TP-free FSDP2
  job has no stake at all.

What it does not capture: a datacenter network (every hop here is a loopback
trip), ranks on their own CPUs (here a few cores run hundreds of simulated ranks,
and every gloo group brings threads of its own, so latencies at many ranks mostly
measure the simulation's own contention: ``benchmarks.transport`` measures a
round on real processes and models a core per rank), and the training work
around the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from benchmarks._scale_workers import (
    HOST,
    STAKE_GROUP,
    Job,
    RankResult,
    Workers,
    raise_fd_limit,
    start_server,
)

__all__ = ["ScaleConfig", "format_scale_table", "main", "run_scale"]

ROW_KEYS = (
    "layout",
    "design",
    "ranks",
    "group",
    "stakes",
    "agreement_ms",
    "critical_ms",
    "operations_per_rank",
    "operations_per_rank_max",
    "server_requests_per_step",
    "setup_requests",
    "modelled",
)
"""The documented keys of every JSON row."""


@dataclass
class ScaleConfig:
    """What the scale simulation runs, and its time bounds."""

    ranks: tuple[int, ...] = (2, 8, 64, 256)
    """Simulated ranks of the configurations (stakes of ``group``)."""
    group: int = 8
    """Ranks per stake (the TP degree); smaller configurations use all their ranks."""
    steps: int = 20
    """Measured steps per configuration."""
    workers: int = 4
    """Worker processes the simulated ranks are spread over (threads in each)."""
    timeout: float = 60.0
    """Bound (seconds) of every round, connection and store wait."""
    job_limit_s: float = 120.0
    """Ranks stop between steps once a configuration has run this long."""

    @classmethod
    def quick(cls) -> ScaleConfig:
        return cls(ranks=(2, 8), steps=3, job_limit_s=30.0)


def _stats(job: Job, results: list[RankResult]) -> dict[str, Any]:
    errors = [r.error for r in results if r.error]
    done = min(len(r.leave) for r in results)
    row: dict[str, Any] = {
        "layout": f"TP={job.group} stakes",
        "design": job.design,
        "ranks": job.ranks,
        "group": job.group,
        "stakes": job.ranks // job.group,
        "modelled": False,
        "steps": done,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }
    if not done:
        return {**row, **dict.fromkeys(ROW_KEYS[5:11])}
    crit, agree = [], []
    for first in range(0, job.ranks, job.group):
        members = results[first : first + job.group]
        for s in range(done):
            last_in = max(r.enter[s] for r in members)
            crit.append(max(r.leave[s] for r in members) - last_in)
            agree.append(max(r.agreed[s] for r in members) - last_in)
    ops = [r.operations[s] for r in results for s in range(done)]
    return {
        **row,
        "agreement_ms": statistics.median(agree) * 1e3,
        "critical_ms": statistics.median(crit) * 1e3,
        "operations_per_rank": statistics.mean(ops),
        "operations_per_rank_max": max(ops),
        "server_requests_per_step": statistics.mean(
            sum(r.requests[s] for r in results) for s in range(done)
        ),
        "setup_requests": sum(r.setup_requests for r in results),
        "wall_ms": statistics.median(
            max(r.leave[s] for r in results) - min(r.enter[s] for r in results)
            for s in range(done)
        ) * 1e3,
    }


def _models(rows: list[dict[str, Any]], group: int) -> list[dict[str, Any]]:
    """The rows at full scale that are not run (see the module docstring)."""
    out = []
    same = [r for r in rows if r["group"] == group and r["steps"]]
    if same:
        basis = min(same, key=lambda r: r["ranks"])  # the least contended measurement
        out.append({
            **{k: basis[k] for k in ROW_KEYS if k in basis},
            "layout": f"PP=16 x DP=128 x TP={group}",
            "ranks": 16384,
            "stakes": 16384 // group,
            "setup_requests": basis["setup_requests"] / basis["ranks"] * 16384,
            "modelled": True,
            "basis": f"{STAKE_GROUP} {basis['ranks']} ranks",
        })
    out.append({
        "layout": "FSDP2 only (no TP)", "design": STAKE_GROUP, "ranks": 1024, "group": 0,
        "stakes": 0, "agreement_ms": 0.0, "critical_ms": 0.0, "operations_per_rank": 0.0,
        "operations_per_rank_max": 0, "server_requests_per_step": 0.0,
        "setup_requests": 0, "modelled": True,
        "basis": "no stake: no round (tests/distributed: zero rounds on real FSDP2 ranks)",
    })
    return out


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
    raise_fd_limit(most * (cfg.group + 4))  # store clients and gloo pairs
    server = start_server(cfg.timeout)
    progress(f"scale simulation: TCPStore on {HOST}:{server.port}, up to {most} "
             f"simulated ranks over {min(cfg.workers, most)} worker processes")
    workers = Workers(cfg.workers, most, server.port, cfg.timeout)
    run_id = uuid.uuid4().hex[:8]
    rows = []
    try:
        for n in cfg.ranks:
            group, design = min(cfg.group, n), STAKE_GROUP
            job = Job(
                prefix=f"bench_scale/{run_id}/{design.replace(' ', '_')}/{n}",
                ranks=n, group=group, design=design, steps=cfg.steps,
                timeout=cfg.timeout, stop_at=time.monotonic() + cfg.job_limit_s,
            )
            t0 = time.monotonic()
            row = _stats(job, workers.run(job))
            progress(f"  {design:<12} N={n:<5} group={group:<5} {time.monotonic() - t0:6.1f} s"
                     f"  errors={row['errors']}")
            rows.append(row)
    finally:
        workers.close()
        del server
    return {
        "machine": machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": asdict(cfg),
        "rows": rows + _models(rows, cfg.group),
    }


_COLUMNS = (
    # header, row key, width, format
    ("agreement ms", "agreement_ms", 12, ".2f"),
    ("critical ms/step", "critical_ms", 16, ".2f"),
    ("ops/rank", "operations_per_rank", 8, ".1f"),
    ("max", "operations_per_rank_max", 4, ".0f"),
    ("store req/step", "server_requests_per_step", 14, ",.0f"),
    ("set-up req", "setup_requests", 10, ",.0f"),
)


def _cell(x: float | None, width: int, fmt: str) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}{fmt}}"


def format_scale_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table; modelled rows are marked ``~``."""
    head = f"{'layout':<24} {'design':<13} {'ranks':>6} {'stakes':>6}" + "".join(
        f" {name:>{width}}" for name, _, width, _ in _COLUMNS
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        design = r["design"] + (" ~" if r["modelled"] else "")
        cells = "".join(f" {_cell(r.get(key), width, fmt)}" for _, key, width, fmt in _COLUMNS)
        errors = f"  ERRORS {r['errors']}: {r['first_error']}" if r.get("errors") else ""
        lines.append(
            f"{r['layout']:<24} {design:<13} {r['ranks']:>6} {r['stakes']:>6}" + cells + errors
        )
    lines += [
        "agreement / critical: from the last member of a stake entering the step's "
        "agreement to the last leaving it / its report, median over stakes and steps",
        "ops/rank: gloo operations per rank and step; store req/step: requests at the "
        "store server per step, steady state; set-up req: the groups' own, once",
        "~: modelled (not run) from the row named in the JSON 'basis'",
    ]
    return "\n".join(lines)


def _config(args: argparse.Namespace) -> ScaleConfig:
    cfg = ScaleConfig.quick() if args.quick else ScaleConfig()
    changes = {
        "ranks": tuple(args.ranks) if args.ranks else None,
        "group": args.group,
        "steps": args.steps,
        "workers": args.workers,
        "timeout": args.timeout,
    }
    return replace(cfg, **{k: v for k, v in changes.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    """Run the simulation, print its table, write its JSON; 1 if any simulated rank
    saw an error."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scale",
        description="The per-step agreement among the ranks at stake (a gloo group "
        "per stake), with simulated ranks.",
    )
    parser.add_argument("--json", default="bench_scale.json", help="write it here")
    parser.add_argument("--quick", action="store_true", help="small configurations")
    parser.add_argument("--ranks", type=int, nargs="+", help="simulated ranks to run")
    parser.add_argument("--group", type=int, help="ranks per stake (TP degree)")
    parser.add_argument("--steps", type=int, help="measured steps")
    parser.add_argument("--workers", type=int, help="worker processes")
    parser.add_argument("--timeout", type=float, help="bound of each round (s)")
    args = parser.parse_args(argv)
    result = run_scale(_config(args))
    print(format_scale_table(result["rows"]))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")
    return 1 if any(r.get("errors") for r in result["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
