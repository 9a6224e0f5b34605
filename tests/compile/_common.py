"""Helpers shared by the compile tests: fresh Dynamo state, grads, saved bytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from remat_dist.testing import SavedBytesCounter


def fresh_dynamo() -> None:
    """Forget every compiled graph: each run compiles its own blocks, and blocks
    share ``nn.Module._call_impl``'s code object, whose cache is bounded."""
    torch._dynamo.reset()


def step(
    module: torch.nn.Module, x: torch.Tensor, loss: Callable[[Any], torch.Tensor]
) -> tuple[int, dict[str, torch.Tensor]]:
    """One forward (saved bytes counted) and backward: ``(activation bytes,
    {"x": grad of x, param name: grad})``."""
    x = x.detach().clone().requires_grad_(True)
    with SavedBytesCounter(module.parameters()) as count:
        out = module(x)
    loss(out).backward()
    grads = {"x": x.grad}
    grads.update({n: p.grad for n, p in module.named_parameters()})
    return count.activation_bytes, grads


def assert_grads_equal(
    ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], **tol: float
) -> None:
    """Bitwise (no ``tol``) or ``torch.testing.assert_close(**tol)``."""
    assert ref.keys() == got.keys()
    for name, r in ref.items():
        g = got[name]
        assert (r is None) == (g is None), name
        if r is None:
            continue
        if tol:
            torch.testing.assert_close(g, r, msg=name, **tol)
        else:
            assert torch.equal(g, r), (name, (g - r).abs().max().item())
