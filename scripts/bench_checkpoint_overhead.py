"""What one checkpoint costs over ``torch.utils.checkpoint``, split by layer.

One small block (7 x Linear(64, 64) + tanh, batch 8) checkpointed, forward +
replay + backward, on a 1-rank gloo group (so the distributed layer is active),
the variants interleaved in each iteration: torch's checkpoint, remat_dist's with
every observer, without the collective ledger's observer, without any observer,
and without observers or RNG state hooks. The differences to torch's row are the
per-checkpoint cost of each part; they do not grow with the block, so their share
of a step shrinks as blocks get bigger.

    python scripts/bench_checkpoint_overhead.py [--iters N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


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
    from remat_dist.core import _record

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
        observers = list(_record._SEAMS.observers)
        variants = {
            "torch.utils.checkpoint": (
                lambda: tuc.checkpoint(block, x0, use_reentrant=False),
                lambda o: True,
            ),
            "remat_dist": (lambda: ck(x0), lambda o: True),
            "- ledger observer": (
                lambda: ck(x0),
                lambda o: "_replay" not in type(o).__module__,
            ),
            "- every observer": (lambda: ck(x0), lambda o: False),
            "- and RNG state hooks": (lambda: ck_bare(x0), lambda o: False),
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        try:
            for it in range(30 + args.iters):
                for name, (fn, keep) in variants.items():
                    _record._SEAMS.observers[:] = [o for o in observers if keep(o)]
                    t0 = time.perf_counter()
                    fn().sum().backward()
                    if it >= 30:
                        times[name].append(time.perf_counter() - t0)
        finally:
            _record._SEAMS.observers[:] = observers
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
