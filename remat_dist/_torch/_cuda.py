"""The CUDA caching allocator's private pieces: its snapshot and its
out-of-memory observer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["attach_oom_observer", "memory_snapshot"]


def memory_snapshot() -> dict[str, Any]:
    """The caching allocator's snapshot (segments, blocks, their history)."""
    return torch.cuda.memory._snapshot()


def attach_oom_observer(observer: Callable[..., None]) -> None:
    """Call ``observer(device, alloc, device_allocated, device_free)`` at every
    CUDA out-of-memory error (a CUDA build only)."""
    torch._C._cuda_attach_out_of_memory_observer(observer)
