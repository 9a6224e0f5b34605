"""A Hugging Face transformers model under FSDP2, with a memory budget.

    torchrun --nproc-per-node 2 examples/quickstart_transformers.py

The Llama is built from a small config (random weights, nothing downloaded).
apply_remat(model) finds its decoder layers by itself and turns the KV cache off
while gradients are on; the budget chooses between recomputing a layer and
keeping its self_attn or mlp. Needs `pip install transformers`.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

import remat_dist as remat
from remat_dist.budget import current_plan
from remat_dist.integrations.transformers import layout


def main():
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if cuda else "cpu"
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         use_cache=False)
    model = LlamaForCausalLM(config).to(device).train()
    remat.apply_remat(model, policy=remat.MemoryBudget(bytes="1MiB"))
    remat.shard_model(model, mesh, blocks=layout(model).block_classes)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    data = torch.Generator().manual_seed(rank)
    for step in range(3):
        ids = torch.randint(0, 256, (4, 32), generator=data).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
            if step == 0:
                print(current_plan(model).format())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
