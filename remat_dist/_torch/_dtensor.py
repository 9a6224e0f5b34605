"""DTensor's private pieces: its RNG tracker, its view rule."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["dtensor_rng_tracker", "views_sequence_shards"]

_RANDOM = "torch.distributed.tensor._random"


def dtensor_rng_tracker() -> Any:
    """DTensor's RNG tracker, or None. Not imported here: if DTensor's random
    module was never imported, no tracker exists and no DTensor random op ran."""
    mod = sys.modules.get(_RANDOM)
    return None if mod is None else getattr(mod, "_rng_tracker", None)


def views_sequence_shards() -> bool:
    """Whether DTensor views a tensor sharded on a dimension after the first
    flattened with the one before it: what a ``Linear`` does to a ``(batch, seq,
    dim)`` DTensor sharded on ``seq``, the output of ``SequenceParallel(
    use_local_output=False)``. torch 2.12 and newer do (as a strided shard);
    torch 2.11 raises "Attempted to flatten multiple dimensions, with dimension 1
    being sharded". Asked of DTensor's view rule, with no process group."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops import _view_ops

    shape = (2, 4, 8)
    rule = _view_ops.view_groups(shape, (8, 8))
    try:
        _view_ops.propagate_shape_and_sharding([Shard(1)], shape, rule, (2,), True)
    except RuntimeError:
        return False
    return True
