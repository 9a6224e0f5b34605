"""FSDP2 x tensor parallelism with a memory budget.

    torchrun --nproc-per-node 4 examples/quickstart_fsdp2_tp.py   # dp=2 x tp=2
    torchrun --nproc-per-node 2 examples/quickstart_fsdp2_tp.py   # dp=1 x tp=2

CPU and gloo as written; with GPUs it takes cuda and nccl. apply_remat with a
MemoryBudget: the first step measures each block, then every rank keeps what fits
in the bytes given. shard_model: TP, then FSDP2 per block and on the root.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import remat_dist as remat
from model import TP_PLAN, Block, Transformer
from remat_dist.budget import current_plan


def main():
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if cuda else "cpu"
    mesh = init_device_mesh(device, (world // 2, 2), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)  # the same initial weights on every rank
    model = Transformer().to(device)
    remat.apply_remat(model, blocks=Block, policy=remat.MemoryBudget(bytes="1536KiB"))
    remat.shard_model(model, mesh, blocks=Block, tp_plan=TP_PLAN)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(1 + dp_rank)  # dropout: a mask per dp rank, shared by TP peers
    data = torch.Generator().manual_seed(dp_rank)
    for step in range(3):
        tokens = torch.randint(0, 256, (8, 33), generator=data).to(device)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        report = remat.gather_saved_tensors_report(loss) if step == 2 else None
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
            if step == 0:  # the plan is chosen in the first step's backward
                print(current_plan(model).format())
    if rank == 0:
        print(report.format())  # what each rank keeps for backward
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
