"""FSDP2 with activation checkpointing, data parallel on every rank.

    torchrun --nproc-per-node 2 examples/quickstart_fsdp2.py

apply_remat checkpoints each block (here keeping its attention's output);
shard_model wraps each block in fully_shard, then the root. Either order works.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import remat_dist as remat
from model import Block, Transformer


def main():
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if cuda else "cpu"
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))

    torch.manual_seed(0)
    model = Transformer().to(device)
    remat.apply_remat(model, blocks=Block, policy={"attention": "save"})
    remat.shard_model(model, mesh, blocks=Block)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    torch.manual_seed(1 + rank)  # dropout: a mask per rank
    data = torch.Generator().manual_seed(rank)
    for step in range(3):
        tokens = torch.randint(0, 256, (8, 33), generator=data).to(device)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
