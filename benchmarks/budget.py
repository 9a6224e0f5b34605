"""``python -m benchmarks.budget``: the memory-budget planner swept over
budgets, on gloo ranks with unequal batches, against full recompute and no
checkpointing.

The reference GPT under FSDP2 on ``--ranks`` CPU ranks started by ``torchrun``; rank
``r`` trains on ``batch * (r + 1)`` sequences (rank 1 twice rank 0's), so the ranks
need different bytes and the planner must plan for the one that needs most. First
no checkpointing and full recompute are measured (saved bytes per rank, as
``SavedBytesCounter`` counts them around ``model(tokens)``); the budgets are the
``--fractions`` of the way from full recompute to no checkpointing, of the rank that
needs most. Per budget a model runs its profiling step, then every variant trains
interleaved (one step of each in turn, a barrier before each).

Per row: the chosen plan (decisions counted), the planner's predicted recompute time,
the saved bytes measured on each rank and whether they fit, the median step time
(forward + backward, slowest rank) and its ratio to no checkpointing. Wall times on
a shared CPU are noisy; the predicted recompute time is what the planner minimises.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from typing import Any

from benchmarks._output import write_json
from benchmarks._torchrun import rank_args, run_worker

__all__ = ["format_budget_table", "main", "run_budget_bench"]

DEFAULTS: dict[str, Any] = {
    "seq": 64, "dim": 128, "heads": 4, "layers": 6, "batch": 2,
    "iters": 10, "warmup": 2, "fractions": [0.25, 0.5, 0.75], "dropout": 0.1,
}


def _build(cfg: dict[str, Any], mesh: Any, policy: Any) -> Any:
    import remat_dist as remat
    from remat_dist.models import GPT, Block, GPTConfig

    config = GPTConfig(
        vocab_size=256, seq_len=cfg["seq"], dim=cfg["dim"], n_heads=cfg["heads"],
        n_layers=cfg["layers"], dropout=cfg["dropout"],
    )
    model = GPT(config)
    if policy is not None:
        remat.apply_remat(model, blocks=Block, policy=policy)
    remat.shard_model(model, mesh, blocks=Block)
    return model


def _step(model: Any, batch: Any, *, count: bool = False) -> tuple[float, int | None]:
    import torch.distributed as dist
    import torch.nn.functional as F

    from remat_dist.testing import SavedBytesCounter

    tokens, targets = batch
    dist.barrier()
    t0 = time.perf_counter()
    if count:
        with SavedBytesCounter(model.parameters()) as counter:
            logits = model(tokens)
        saved: int | None = counter.activation_bytes
    else:
        logits, saved = model(tokens), None
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    elapsed = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return elapsed, saved


def bench_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs on every rank; returns this rank's measurements (rank 0: with plans)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import remat_dist as remat
    from remat_dist.distributed import all_gather_objects
    from remat_dist.models import GPTConfig, make_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    config = GPTConfig(vocab_size=256, seq_len=cfg["seq"], dim=cfg["dim"], n_heads=cfg["heads"])
    batch = make_batch(config, cfg["batch"] * (rank + 1), seed=rank)
    models: dict[str, Any] = {"none": _build(cfg, mesh, None), "full": _build(cfg, mesh, "full")}
    saved = {v: _step(m, batch, count=True)[1] for v, m in models.items()}
    lo = max(all_gather_objects(saved["full"]))
    hi = max(all_gather_objects(saved["none"]))
    budgets = {}
    for frac in cfg["fractions"]:
        name = f"budget {frac:.2f}"
        budgets[name] = int(lo + frac * (hi - lo))
        models[name] = _build(cfg, mesh, remat.MemoryBudget(bytes=budgets[name]))
        _step(models[name], batch)  # the profiling step
    names = list(models)
    for v in names:
        saved[v] = _step(models[v], batch, count=True)[1]
    times: dict[str, list[float]] = {v: [] for v in names}
    for it in range(cfg["warmup"] + cfg["iters"]):
        for v in names[it % len(names):] + names[: it % len(names)]:
            elapsed = _step(models[v], batch)[0]
            if it >= cfg["warmup"]:
                times[v].append(elapsed)
    rows = []
    for v in names:
        plan = remat.budget.current_plan(models[v]) if v in budgets else None
        rows.append({
            "variant": v,
            "budget": budgets.get(v),
            "saved_bytes": saved[v],
            "time_s": statistics.median(times[v]),
            "decisions": None if plan is None else plan.decisions(),
            "predicted_bytes": None if plan is None else plan.predicted_bytes,
            "predicted_recompute_s": None if plan is None else plan.predicted_time_s,
        })
    return {"rank": rank, "batch": cfg["batch"] * (rank + 1), "rows": rows}


def _torchrun_main(json_path: str, cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from remat_dist.distributed import all_gather_objects

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mine = bench_rank(cfg)
        per_rank = all_gather_objects(mine)
        if dist.get_rank() == 0:
            rows = []
            for i, row in enumerate(mine["rows"]):
                row = dict(row)
                row["saved_bytes_per_rank"] = [r["rows"][i]["saved_bytes"] for r in per_rank]
                row["time_s_per_rank"] = [r["rows"][i]["time_s"] for r in per_rank]
                rows.append(row)
            with open(json_path, "w") as f:
                json.dump({
                    "world_size": dist.get_world_size(),
                    "batch_per_rank": [r["batch"] for r in per_rank],
                    "config": cfg,
                    "rows": rows,
                }, f, indent=2)
    finally:
        dist.destroy_process_group()


def run_budget_bench(ranks: int = 2, **cfg: Any) -> dict[str, Any]:
    """The sweep on ``ranks`` local CPU ranks under ``torchrun``; rank 0's rows with
    every rank's saved bytes and step times."""
    full = dict(DEFAULTS, **cfg)
    return run_worker("benchmarks.budget", ranks, full, "budget benchmark")


def _plan_text(decisions: dict[str, str] | None) -> str:
    if decisions is None:
        return "-"
    counts = Counter(decisions.values())
    order = sorted(counts, key=lambda d: (d != "full", d == "none", d))
    return ", ".join(f"{counts[d]}x {d}" for d in order)


def format_budget_table(result: dict[str, Any]) -> str:
    """A fixed-width table of the sweep."""
    rows = result["rows"]
    base = next(max(r["time_s_per_rank"]) for r in rows if r["variant"] == "none")
    nranks = result["world_size"]
    head = (
        f"{'variant':<12} {'budget KiB':>10} {'plan':<56} {'pred recomp ms':>14} "
        f"{'saved KiB/rank':>16} {'fits':>4} {'step ms':>8} {'x none':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        saved = "/".join(f"{b / 1024:.0f}" for b in r["saved_bytes_per_rank"])
        budget = r["budget"]
        fits = "-" if budget is None else (
            "yes" if max(r["saved_bytes_per_rank"]) <= budget else "NO"
        )
        pred = r["predicted_recompute_s"]
        step = max(r["time_s_per_rank"])
        lines.append(
            f"{r['variant']:<12} {'-' if budget is None else f'{budget / 1024:.0f}':>10} "
            f"{_plan_text(r['decisions']):<56} "
            f"{'-' if pred is None else f'{pred * 1e3:.2f}':>14} {saved:>16} {fits:>4} "
            f"{step * 1e3:8.1f} {step / base:6.3f}"
        )
    lines.append(
        f"({nranks} gloo ranks, FSDP2, batches per rank {result['batch_per_rank']}; "
        "step ms: median forward+backward of the slowest rank)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.budget", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--ranks", type=int, default=2)
    for key in ("seq", "dim", "heads", "layers", "batch", "iters", "warmup"):
        parser.add_argument(f"--{key}", type=int, default=DEFAULTS[key])
    parser.add_argument("--dropout", type=float, default=DEFAULTS["dropout"])
    parser.add_argument(
        "--fractions", type=float, nargs="+", default=DEFAULTS["fractions"],
        help="budgets: fractions of the way from full recompute to no checkpointing",
    )
    parser.add_argument("--json", default=None, help="write the results to this path")
    args = parser.parse_args(argv)
    cfg = {k: getattr(args, k) for k in DEFAULTS}
    result = run_budget_bench(args.ranks, **cfg)
    print(format_budget_table(result))
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    if (rank := rank_args(sys.argv[1:])) is not None:
        _torchrun_main(*rank)
    else:
        raise SystemExit(main())
