"""A tiny tensor-parallel MLP shared by the distributed tests."""

from __future__ import annotations

import torch
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)


def tp_mlp(mesh) -> torch.nn.Module:
    """Linear(8, 16) column-wise, ReLU, Linear(16, 8) row-wise: one all-reduce in
    forward, one in backward. Seeded: the same weights on every rank."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    return parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
