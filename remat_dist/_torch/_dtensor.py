"""DTensor's private pieces: its RNG tracker."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["dtensor_rng_tracker"]

_RANDOM = "torch.distributed.tensor._random"


def dtensor_rng_tracker() -> Any:
    """DTensor's RNG tracker, or None. Not imported here: if DTensor's random
    module was never imported, no tracker exists and no DTensor random op ran."""
    mod = sys.modules.get(_RANDOM)
    return None if mod is None else getattr(mod, "_rng_tracker", None)
