"""The count guard: a MoE module inside a checkpointed block adds its token counts
once per forward, not again when remat_dist replays it (see the package doc)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from remat_dist._torch._module import buffers_of
from remat_dist.core import is_recomputing
from remat_dist.integrations.torchtitan._config import COUNTER_BUFFERS, GUARD_ATTR

__all__ = ["guard_counters", "guarded_counters"]

def guard_counters(block: nn.Module) -> int:
    count = 0
    for module in block.modules():
        buffer = next((b for b in COUNTER_BUFFERS if b in buffers_of(module)), None)
        if buffer is None or GUARD_ATTR in module.__dict__:
            continue
        _install_guard(module, buffer)
        count += 1
    return count


def _install_guard(module: nn.Module, buffer: str) -> None:
    previous = module.__dict__.get("forward")
    inner = previous if previous is not None else type(module).forward.__get__(module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not is_recomputing():
            return inner(*args, **kwargs)
        real = buffers_of(module)[buffer]
        # The replay counts into a scratch tensor; the forward already counted.
        buffers_of(module)[buffer] = torch.zeros_like(real)
        try:
            return inner(*args, **kwargs)
        finally:
            buffers_of(module)[buffer] = real

    module.forward = forward
    module.__dict__[GUARD_ATTR] = (buffer, previous)


def guarded_counters(model: nn.Module) -> list[str]:
    """Qualified names of the modules whose MoE token counter :func:`apply_ac`
    guards."""
    return [name for name, m in model.named_modules() if GUARD_ATTR in m.__dict__]
