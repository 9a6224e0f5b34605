"""Whether a process group is up, and this process's rank: the one check every
rank-aware piece makes before doing anything (cheap: it never imports
``torch.distributed`` itself when nothing else has)."""

from __future__ import annotations

import sys

__all__ = ["dist_ready", "this_rank"]


def dist_ready() -> bool:
    """True when ``torch.distributed`` is available and initialised."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def this_rank() -> int | None:
    """This process's global rank, or None without a process group."""
    if not dist_ready():
        return None
    return sys.modules["torch.distributed"].get_rank()
