"""``python -m remat_dist report``: the cross-rank saved-tensor report of the
reference GPT, on ``--nproc`` local CPU ranks (or on the ranks of a ``torchrun``).

    python -m remat_dist report --nproc 2 --remat attention
    python -m remat_dist report --nproc 4 --tp 2 --uneven --json report.json

Each rank builds the model (FSDP2, optional TP), checkpoints every block with the
chosen policy, runs one forward on its own batch, and the per-rank summaries are
gathered into one :class:`~remat_dist.report.CrossRankReport`. ``--uneven`` gives
rank ``r`` a batch of ``batch * (r + 1)`` sequences, to show the heaviest rank.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

POLICIES: dict[str, Any] = {
    "full": "full",
    "attention": {"attention": "save"},
    "mlp": {"mlp": "save"},
    "none": None,
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m remat_dist report", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="local CPU ranks (ignored under torchrun)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--remat", choices=sorted(POLICIES), default="attention")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--uneven", action="store_true", help="rank r gets batch*(r+1)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--json", default=None, help="also write the report's to_dict() here")
    return p.parse_args(argv)


def report_on_this_rank(opts: dict[str, Any]) -> dict[str, Any] | None:
    """Build, shard, checkpoint and run the reference GPT once on this rank; the
    report's ``to_dict()`` on rank 0, None elsewhere. Needs a process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import remat_dist as remat
    from remat_dist.models import GPT, Block, GPTConfig, make_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    tp = opts["tp"]
    if world % tp:
        raise SystemExit(f"remat_dist report: --tp {tp} does not divide {world} ranks")
    config = GPTConfig(vocab_size=256, seq_len=opts["seq"], dim=opts["dim"], n_heads=4, n_layers=opts["layers"])
    model = GPT(config)
    policy = POLICIES[opts["remat"]]
    if policy is not None:
        remat.apply_remat(model, blocks=Block, policy=policy)
    if tp > 1:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        remat.shard_model(model, mesh, blocks=Block, tp_plan=remat.shard.reference_tp_plan())
        dp_rank = mesh["dp"].get_local_rank()
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        remat.shard_model(model, mesh, blocks=Block)
        dp_rank = rank
    batch = opts["batch"] * (dp_rank + 1 if opts["uneven"] else 1)
    tokens, targets = make_batch(config, batch, seed=dp_rank)
    loss = model.loss(tokens, targets)
    report = remat.gather_saved_tensors_report(loss)
    loss.backward()
    return None if report is None else report.to_dict()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    opts = vars(args)
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        result = report_on_this_rank(opts)
    else:
        from remat_dist.testing import run_distributed

        result = run_distributed(report_on_this_rank, opts, world_size=args.nproc, timeout=300)[0]
    if result is None:
        return 0
    from remat_dist.report import CrossRankReport

    print(CrossRankReport.from_dict(result).format())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0
