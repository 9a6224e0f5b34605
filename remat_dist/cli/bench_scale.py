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

from remat_dist.cli._scale_workers import (
    HOST,
    PER_CHECKPOINT,
    STEP,
    Job,
    RankResult,
    Workers,
    raise_fd_limit,
    start_server,
)

__all__ = ["ScaleConfig", "format_scale_table", "main", "run_scale"]

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
        self, cfg: ScaleConfig, workers: Workers, progress: Callable[[str], None]
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
    raise_fd_limit(most)
    server = start_server(cfg.timeout)
    progress(f"scale simulation: TCPStore on {HOST}:{server.port}, "
             f"{most} simulated ranks over {min(cfg.workers, most)} worker processes")
    workers = Workers(cfg.workers, most, server.port, cfg.timeout)
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
