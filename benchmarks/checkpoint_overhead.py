"""What one checkpoint costs over ``torch.utils.checkpoint``, split by layer.

One small block (7 x Linear(64, 64) + tanh, batch 8) checkpointed, forward +
replay + backward, on a 1-rank gloo group (so the distributed layer is active),
the variants interleaved in each iteration: torch's checkpoint, remat_dist's with
every observer, without the collective ledger's observer, without any observer,
and without observers or RNG state hooks. The differences to torch's row are the
per-checkpoint cost of each part; they do not grow with the block, so their share
of a step shrinks as blocks get bigger.

    python -m benchmarks.checkpoint_overhead [--iters N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _noop(*args: object) -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29691")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import torch
    import torch.distributed as dist
    import torch.utils.checkpoint as tuc

    import remat_dist as remat
    from remat_dist.distributed import _replay, _values

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        lin = torch.nn.Linear(64, 64)

        def block(x: torch.Tensor) -> torch.Tensor:
            for _ in range(7):
                x = torch.tanh(lin(x))
            return x

        x0 = torch.randn(8, 64, requires_grad=True)
        ck = remat.checkpoint(region_name="blk")(block)
        ck_bare = remat.checkpoint(region_name="bare", recompute_state_hooks=())(block)
        # an observer is left out by making its callbacks no-ops (the core still
        # calls them, in their registered order)
        classes = (_replay._LedgerObserver, _values._ValuesObserver)
        events = (
            "on_checkpoint_start",
            "on_checkpoint_end",
            "on_region_start",
            "on_region_end",
        )
        originals = {
            (c, e): c.__dict__[e] for c in classes for e in events if e in c.__dict__
        }

        def only(*kept: type) -> None:
            for (cls, event), fn in originals.items():
                setattr(cls, event, fn if cls in kept else _noop)

        every = classes
        variants = {
            "torch.utils.checkpoint": (
                lambda: tuc.checkpoint(block, x0, use_reentrant=False),
                every,
            ),
            "remat_dist": (lambda: ck(x0), every),
            "- ledger observer": (lambda: ck(x0), (_values._ValuesObserver,)),
            "- every observer": (lambda: ck(x0), ()),
            "- and RNG state hooks": (lambda: ck_bare(x0), ()),
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        try:
            for it in range(30 + args.iters):
                for name, (fn, kept) in variants.items():
                    only(*kept)
                    t0 = time.perf_counter()
                    fn().sum().backward()
                    if it >= 30:
                        times[name].append(time.perf_counter() - t0)
        finally:
            only(*every)
    finally:
        dist.destroy_process_group()
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    base = med["torch.utils.checkpoint"]
    print(f"{'variant':26s} {'us/iter':>9s} {'vs torch':>9s}")
    for k, v in med.items():
        print(f"{k:26s} {v:9.1f} {v - base:+9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_us": med, "iters": args.iters}, f, indent=1)


if __name__ == "__main__":
    main()
