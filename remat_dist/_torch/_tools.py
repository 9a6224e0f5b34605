"""torch's memory tracker (``torch.distributed._tools``), used by the benchmarks."""

from __future__ import annotations

from typing import Any

__all__ = ["mem_tracker"]


def mem_tracker() -> tuple[Any, Any] | None:
    """``(MemTracker, the memory reference kinds)``; None where it is missing."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    except ImportError:
        return None
    return MemTracker, _MemRefType
