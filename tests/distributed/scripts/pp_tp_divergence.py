"""A PP=2 x TP=2 training script (4 ranks under torchrun) in which rank 3 keeps its
blocks' attention while its TP peer recomputes it: a bug confined to stage 1's TP
group. Ranks 2 and 3 raise PlanMismatchError at their first backward and exit with
it, as any uncaught error ends a worker; ranks 0 and 1 (stage 0) were not at stake
and wait in the pipeline's receive until torchrun's agent stops them."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, sys.argv[1])  # the repository root: tests/ is a package there

import remat_dist as remat  # noqa: E402
from tests.distributed.test_pipeline import _train  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    rank = dist.get_rank()
    pp, tp = mesh["pp"], mesh["tp"]
    policy = {"attention": "save"} if rank == 3 else "full"
    t0 = time.monotonic()
    try:
        _train(
            None, "Schedule1F1B", remat_policy=policy, pp_group=pp.get_group(),
            pp_rank=pp.get_local_rank(), pp_size=2, tp_mesh=tp, steps=1,
        )
    except remat.errors.PlanMismatchError as e:
        print(f"[rank {rank}] raised after {time.monotonic() - t0:.2f} s: {e}", file=sys.stderr, flush=True)
        raise
    print(f"[rank {rank}] finished without error", file=sys.stderr, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
