"""``python -m remat_dist.testing``: measure what the harness costs on this machine.

Prints (and with ``--json PATH`` writes) the cold start of a 2- and a 4-rank pool,
the per-call cost of a trivial call once warm, and the cost of replacing a pool
after a failure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from remat_dist.testing import (
    DistributedTestError,
    pool_stats,
    run_distributed,
    shutdown_pools,
)


def _trivial() -> int:
    return dist.get_rank()


def _all_reduce() -> float:
    t = torch.ones(4)
    dist.all_reduce(t)
    return float(t[0])


def _fail_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("deliberate")
    dist.barrier()


def _timed(fn, world_size: int, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_distributed(fn, world_size=world_size)
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remat_dist.testing")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args(argv)

    report: dict[str, float | str] = {}
    for ws in (2, 4):
        t0 = time.perf_counter()
        run_distributed(_trivial, world_size=ws)
        report[f"cold_start_{ws}_ranks_s"] = time.perf_counter() - t0
        trivial = _timed(_trivial, ws, args.repeats)
        report[f"warm_trivial_{ws}_ranks_median_s"] = statistics.median(trivial)
        report[f"warm_trivial_{ws}_ranks_max_s"] = max(trivial)
        report[f"warm_all_reduce_{ws}_ranks_median_s"] = statistics.median(
            _timed(_all_reduce, ws, args.repeats)
        )
    t0 = time.perf_counter()
    try:
        run_distributed(_fail_on_rank_1, world_size=2, timeout=30)
    except DistributedTestError:
        pass
    report["failure_report_2_ranks_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    run_distributed(_trivial, world_size=2)
    report["first_call_after_replacement_2_ranks_s"] = time.perf_counter() - t0
    report["start_method"] = pool_stats()[2].start_method
    shutdown_pools()

    for key, value in report.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"{key:42s} {shown}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
