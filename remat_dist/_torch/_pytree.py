"""Flattening nested containers (torch's pytree)."""

from __future__ import annotations

from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves, tree_map

__all__ = ["keystr", "tree_flatten_with_path", "tree_leaves", "tree_map"]
