"""Activation checkpointing in one process: one line of remat_dist.

    python examples/quickstart_single.py

Each block keeps only its input and its attention's output; backward recomputes
the rest (the MLP). Dropout replays the same mask: remat_dist keeps the generator.
"""

import torch

import remat_dist as remat
from model import Block, Transformer


def main():
    torch.manual_seed(0)
    model = Transformer()
    remat.apply_remat(model, blocks=Block, policy={"attention": "save"})
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(0)
    for step in range(3):
        tokens = torch.randint(0, 256, (8, 33), generator=data)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        if step == 0:
            print(remat.format_saved_tensors_report(loss).splitlines()[0])
        loss.backward()
        optim.step()
        optim.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
