"""Pipeline parallelism (torch.distributed.pipelining) with a memory budget.

    torchrun --nproc-per-node 2 examples/quickstart_pipeline.py

Each rank runs one stage (two blocks) of a 1F1B schedule over 4 micro-batches.
A MemoryBudget plans per stage: it counts the micro-batches the schedule keeps
alive on that stage, so the first stage (more in flight) may keep less per block.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import remat_dist as remat
from model import Block, Transformer
from remat_dist.budget import current_plan


class Stage(nn.Module):
    """The part of ``model`` one rank runs: its blocks, plus the embedding on the
    first stage and the head on the last."""

    def __init__(self, model, rank, stages):
        super().__init__()
        per_stage = len(model.layers) // stages
        mine = range(rank * per_stage, (rank + 1) * per_stage)
        self.embed = model.embed if rank == 0 else None
        self.layers = nn.ModuleList(model.layers[i] for i in mine)
        last = rank == stages - 1
        self.norm, self.head = (model.norm, model.head) if last else (None, None)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x if self.head is None else self.head(self.norm(x))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main():
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda" if cuda else "cpu")

    torch.manual_seed(0)
    stage = Stage(Transformer(), rank, world).to(device)
    remat.apply_remat(stage, blocks=Block, policy=remat.MemoryBudget(bytes="1MiB"))
    schedule = Schedule1F1B(PipelineStage(stage, rank, world, device),
                            n_microbatches=4, loss_fn=loss_fn)
    optim = torch.optim.AdamW(stage.parameters(), lr=1e-3)

    torch.manual_seed(1 + rank)
    data = torch.Generator().manual_seed(0)  # every rank draws the same batch
    for step in range(3):
        tokens = torch.randint(0, 256, (8, 33), generator=data).to(device)
        losses = []
        if rank == 0:
            schedule.step(tokens[:, :-1])
        else:
            schedule.step(target=tokens[:, 1:], losses=losses)
        optim.step()
        optim.zero_grad()
        if rank == world - 1:
            print(f"step {step}: loss {torch.stack(losses).mean().item():.4f}")
    dist.barrier()
    print(f"stage {rank}: {current_plan(stage).format()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
