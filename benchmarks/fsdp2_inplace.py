"""Where a checkpoint's own Python time goes, timed in place between the kernels.

``benchmarks.fsdp2_overhead`` gives the ratio of whole steps; this script times the
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
- **backward**: from the gradient of the block's output to the gradient of its
  input (tensor hooks on both): the replay, its set-up and check, and the
  block's backward kernels, which are the same in both variants.

Medians in microseconds, and remat_dist's excess over torch's, printed as a table
and written as JSON. Timing hooks add about a microsecond each, the same in both
variants; compare rows of one run.

    python -m benchmarks.fsdp2_inplace [--iters N] [--json PATH]
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

    from benchmarks.dist import one_rank_fsdp2_bench
    from remat_dist.models import Block, make_batch

    config, build = one_rank_fsdp2_bench(port=29731)
    tokens, targets = make_batch(config, 4, seed=0)
    clock = time.perf_counter_ns
    stamps: dict[str, int] = {}
    timing = {"on": False, "variant": ""}
    variants = ("torch", "remat_dist")
    pieces = ("forward pre", "forward post", "backward")
    samples = {v: {p: [] for p in pieces} for v in variants}

    block_forward = Block.forward

    def timed_forward(self: Any, *a: Any, **k: Any) -> Any:
        stamps["body start"] = clock()
        out = block_forward(self, *a, **k)
        stamps["body end"] = clock()
        return out

    Block.forward = timed_forward  # type: ignore[method-assign]
    try:
        models = {v: build(v) for v in variants}
        for variant, model in models.items():
            for block in (b for b in model.modules() if isinstance(b, Block)):

                def pre(module: Any, inputs: Any) -> None:
                    stamps["pre hook"] = clock()

                def post(module: Any, inputs: Any, out: Any, variant: str = variant) -> None:
                    end = clock()
                    if not (timing["on"] and timing["variant"] == variant):
                        return
                    mine = samples[variant]
                    mine["forward pre"].append(stamps["body start"] - stamps["pre hook"])
                    mine["forward post"].append(end - stamps["body end"])
                    started: list[int] = []
                    out.register_hook(lambda grad: started.append(clock()))
                    inputs[0].register_hook(
                        lambda grad: mine["backward"].append(clock() - started[0])
                    )

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
        dist.destroy_process_group()

    rows: dict[str, dict[str, Any]] = {}
    for piece in pieces:
        mine, theirs = samples["remat_dist"][piece], samples["torch"][piece]
        us, ref = statistics.median(mine) / 1e3, statistics.median(theirs) / 1e3
        rows[piece] = {
            "samples": {"remat_dist": len(mine), "torch": len(theirs)},
            "remat_us": us,
            "torch_us": ref,
            "excess_us": us - ref,
        }
    print(f"{'piece':14s} {'remat us':>9s} {'torch us':>9s} {'excess us':>10s}")
    for piece, row in rows.items():
        print(
            f"{piece:14s} {row['remat_us']:9.1f} {row['torch_us']:9.1f} "
            f"{row['excess_us']:+10.1f}"
        )
    print(f"({args.iters} steps of {config.n_layers} checkpoints each, medians)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"iters": args.iters, "config": vars(config), "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
