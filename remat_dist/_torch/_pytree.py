"""Flattening nested containers (torch's pytree)."""

from __future__ import annotations

from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["tree_leaves", "tree_map"]
