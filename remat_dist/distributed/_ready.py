"""Whether a process group is up, and this process's rank: the one check every
rank-aware piece makes before doing anything (cheap: it never imports
``torch.distributed`` itself when nothing else has)."""

from __future__ import annotations

import sys

from remat_dist._torch import _c10d

__all__ = ["dist_ready", "this_rank"]


dist_ready = _c10d.default_group_initialized
"""True when ``torch.distributed`` is available and initialised."""


def this_rank() -> int | None:
    """This process's global rank, or None without a process group."""
    if not dist_ready():
        return None
    return sys.modules["torch.distributed"].get_rank()
