"""Where a checkpoint's own Python time goes, timed in place between the kernels.

``bench_fsdp2_overhead.py`` gives the ratio of whole steps; this script times the
pieces that ratio is made of, inside the same FSDP2 layout (the reference GPT,
dim 128, 4 blocks, FSDP2 unit per block, the checkpoint inside each unit, a
1-rank gloo group), per checkpoint call and as the model runs them, so each
piece pays what it pays between the model's kernels (two to five times its warm
cost on this box: the kernels evict what the Python touches).

Per block call, for remat_dist and ``torch.utils.checkpoint`` interleaved:

- **forward pre**: from the block's forward pre-hook (FSDP2's unshard done) to the
  first line of the block's own ``forward``: the checkpoint's set-up;
- **forward post**: from the block's ``forward`` returning to its forward hook:
  the checkpoint's wrap-up;
- for remat_dist, **replay enter** and **replay exit**: its recompute context's
  ``__enter__`` and ``__exit__`` (state restore, observers, the replay's check).

Medians in microseconds, printed as a table and written as JSON. Timing wraps add
about a microsecond each, the same in both variants; compare rows of one run.

    python scripts/bench_fsdp2_inplace.py [--iters N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch.distributed as dist

    from remat_dist.cli.bench_dist import one_rank_fsdp2_bench
    from remat_dist.core import _checkpoint
    from remat_dist.models import Block, make_batch

    config, build = one_rank_fsdp2_bench(port=29731)
    tokens, targets = make_batch(config, 4, seed=0)
    clock = time.perf_counter_ns
    stamps: dict[str, int] = {}
    timing = {"on": False, "variant": ""}
    variants = ("torch", "remat_dist")
    samples: dict[str, dict[str, list[int]]] = {
        v: {"forward pre": [], "forward post": []} for v in variants
    }
    samples["remat_dist"].update({"replay enter": [], "replay exit": []})

    block_forward = Block.forward

    def timed_forward(self: Any, *a: Any, **k: Any) -> Any:
        stamps["body start"] = clock()
        out = block_forward(self, *a, **k)
        stamps["body end"] = clock()
        return out

    Block.forward = timed_forward  # type: ignore[method-assign]
    enter, exit_ = _checkpoint._Phase.__enter__, _checkpoint._Phase.__exit__

    def timed_enter(phase: Any) -> Any:
        if not phase.replay or not timing["on"]:
            return enter(phase)
        t = clock()
        out = enter(phase)
        samples["remat_dist"]["replay enter"].append(clock() - t)
        return out

    def timed_exit(phase: Any, *exc: Any) -> Any:
        if not phase.replay or not timing["on"]:
            return exit_(phase, *exc)
        t = clock()
        out = exit_(phase, *exc)
        samples["remat_dist"]["replay exit"].append(clock() - t)
        return out

    _checkpoint._Phase.__enter__ = timed_enter  # type: ignore[method-assign]
    _checkpoint._Phase.__exit__ = timed_exit  # type: ignore[method-assign]
    try:
        models = {v: build(v) for v in variants}
        for variant, model in models.items():
            for block in (b for b in model.modules() if isinstance(b, Block)):

                def pre(module: Any, inputs: Any) -> None:
                    stamps["pre hook"] = clock()

                def post(module: Any, inputs: Any, out: Any, variant: str = variant) -> None:
                    end = clock()
                    if timing["on"] and timing["variant"] == variant:
                        mine = samples[variant]
                        mine["forward pre"].append(stamps["body start"] - stamps["pre hook"])
                        mine["forward post"].append(end - stamps["body end"])

                block.register_forward_pre_hook(pre)  # after FSDP2's unshard
                block.register_forward_hook(post, prepend=True)  # before its reshard
        warmup = 20
        for it in range(warmup + args.iters):
            for variant in variants if it % 2 else variants[::-1]:
                timing["on"] = it >= warmup
                timing["variant"] = variant
                model = models[variant]
                model.loss(tokens, targets).backward()
                model.zero_grad(set_to_none=True)
    finally:
        Block.forward = block_forward  # type: ignore[method-assign]
        _checkpoint._Phase.__enter__ = enter  # type: ignore[method-assign]
        _checkpoint._Phase.__exit__ = exit_  # type: ignore[method-assign]
        dist.destroy_process_group()

    rows: dict[str, dict[str, Any]] = {}
    for piece in ("forward pre", "forward post", "replay enter", "replay exit"):
        mine = samples["remat_dist"][piece]
        theirs = samples["torch"].get(piece)
        us = statistics.median(mine) / 1e3
        ref = statistics.median(theirs) / 1e3 if theirs else None
        rows[piece] = {
            "samples": len(mine),
            "remat_us": us,
            "torch_us": ref,
            "excess_us": None if ref is None else us - ref,
        }
    print(f"{'piece':14s} {'remat us':>9s} {'torch us':>9s} {'excess us':>10s}")
    for piece, row in rows.items():
        ref, excess = row["torch_us"], row["excess_us"]
        print(
            f"{piece:14s} {row['remat_us']:9.1f} "
            f"{'-' if ref is None else f'{ref:.1f}':>9s} "
            f"{'-' if excess is None else f'{excess:+.1f}':>10s}"
        )
    print(f"({args.iters} steps of {config.n_layers} checkpoints each, medians)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"iters": args.iters, "config": vars(config), "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
