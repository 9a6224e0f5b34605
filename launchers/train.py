"""Train the reference GPT with FSDP2 and per-block activation checkpointing.

Run by torchrun (CPU + gloo by default)::

    torchrun --standalone --nproc-per-node 2 launchers/train.py --steps 5

Rank 0 prints one line per step (loss averaged over ranks, step time). At the end
every rank measures the bytes saved for backward by one forward pass, with and
without checkpointing, and prints them prefixed with its rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import remat_dist as remat
from remat_dist.models import GPT, GPTConfig, make_batch


def checkpoint_block(
    block: torch.nn.Module, x: torch.Tensor, name: str
) -> torch.Tensor:
    """Run one transformer block under activation checkpointing.

    The single place that decides how a block is checkpointed (``name`` is its
    qualified name, ``"layers.0"``, ...).
    """
    return remat.checkpoint(region_name=name)(block)(x)


# -- saved-for-backward accounting --------------------------------------------

def _note(seen: dict[int, torch.UntypedStorage], t: torch.Tensor) -> None:
    local = getattr(t, "_local_tensor", t)  # a DTensor's bytes are its local shard
    try:
        storage = local.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return
    # Keyed by the storage itself, not its address: FSDP frees unsharded
    # parameters after forward, and a freed address can be handed out again.
    key = getattr(storage, "_cdata", None) or storage.data_ptr()
    seen[key] = storage


@contextmanager
def count_saved_storages() -> Iterator[dict[int, torch.UntypedStorage]]:
    """Outermost ``remat.saved_tensors_hooks``: record every unique storage
    packed, checkpoint inputs included."""
    seen: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        _note(seen, t)
        return t

    with remat.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def saved_bytes_for_one_forward(
    model: GPT, tokens: torch.Tensor, targets: torch.Tensor
) -> int:
    """Bytes held for backward between one forward and its backward: the unique
    storages saved, sized after the forward (full parameters that FSDP frees
    after forward, to gather again for backward, count as nothing)."""
    with count_saved_storages() as seen:
        loss = model.loss(tokens, targets)
    total = sum(s.nbytes() for s in seen.values())
    loss.backward()  # free the graph (and keep FSDP's state machine in step)
    model.zero_grad(set_to_none=True)
    return total


# -- the job --------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-checkpoint", action="store_true", help="train without checkpointing"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print(
            "launchers/train.py is run by torchrun, e.g.\n"
            "  torchrun --standalone --nproc-per-node 2 launchers/train.py --steps 5",
            file=sys.stderr,
        )
        return 2
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        run(args, rank, world)
    finally:
        dist.destroy_process_group()
    return 0


def run(args: argparse.Namespace, rank: int, world: int) -> None:
    config = GPTConfig(
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        dim=args.dim,
        n_heads=args.n_heads,
        n_layers=args.n_layers,
        dropout=args.dropout,
        seed=args.seed,
    )
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = GPT(config)
    n_params = sum(p.numel() for p in model.parameters())
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not args.no_checkpoint:
        model.block_runner = checkpoint_block
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)

    if rank == 0:
        print(
            f"GPT: {config.n_layers} layers, dim {config.dim}, {n_params:,} params; "
            f"FSDP2 over {world} ranks (gloo, CPU); "
            f"checkpointing: {'off' if args.no_checkpoint else 'per block'}",
            flush=True,
        )
    torch.manual_seed(args.seed + rank)  # dropout masks differ per rank
    for step in range(1, args.steps + 1):
        tokens, targets = make_batch(
            config, args.batch_size, seed=args.seed * 100_003 + step * world + rank
        )
        t0 = time.perf_counter()
        loss = model.loss(tokens, targets)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        step_s = time.perf_counter() - t0
        if rank == 0:
            print(
                f"step {step}/{args.steps}  loss {mean_loss.item():.4f}  "
                f"time {step_s:.3f}s",
                flush=True,
            )

    tokens, targets = make_batch(config, args.batch_size, seed=rank)
    runner = model.block_runner
    model.block_runner = None
    plain = saved_bytes_for_one_forward(model, tokens, targets)
    model.block_runner = checkpoint_block
    ckpt = saved_bytes_for_one_forward(model, tokens, targets)
    model.block_runner = runner
    dist.barrier()
    for r in range(world):  # ordered output
        if r == rank:
            print(
                f"[rank {rank}] saved-for-backward bytes for one forward: "
                f"{ckpt:,} with per-block checkpointing, {plain:,} without "
                f"({ckpt / plain:.1%})",
                flush=True,
            )
        dist.barrier()


if __name__ == "__main__":
    raise SystemExit(main())
