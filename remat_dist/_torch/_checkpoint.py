"""``torch.utils.checkpoint``'s internals that remat_dist builds on, and torch's
``checkpoint_wrapper`` (to refuse nesting inside it)."""

from __future__ import annotations

from typing import Any

import torch.utils.checkpoint as _tc

__all__ = [
    "CheckpointFrame",
    "Holder",
    "StopRecomputationError",
    "checkpoint_wrapper_types",
    "early_stop_enabled",
]

StopRecomputationError: type[BaseException] = _tc._StopRecomputationError
"""What torch's checkpoint raises to stop a replay early (at the last saved tensor)."""

Holder: Any = _tc._Holder
"""The packed stand-in of a tensor torch's checkpoint recomputes."""

CheckpointFrame: Any = _tc._CheckpointFrame
"""What torch's non-reentrant checkpoint keeps per call (recompute fn, inputs)."""


def early_stop_enabled() -> bool:
    """Whether torch's checkpoint stops a replay at its last saved tensor now
    (``torch.utils.checkpoint.set_checkpoint_early_stop``)."""
    return _tc._enable_checkpoint_early_stop is not False


def checkpoint_wrapper_types() -> tuple[type, ...]:
    """torch's ``CheckpointWrapper`` class (empty without ``torch.distributed``)."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointWrapper,
        )
    except Exception:  # pragma: no cover - no torch.distributed
        return ()
    return (CheckpointWrapper,)
