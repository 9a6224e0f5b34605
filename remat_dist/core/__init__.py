"""The single-process runtime: checkpoint, regions, placeholders, state hooks, scope.

Knows nothing of ranks; ``remat_dist.distributed`` attaches through
:func:`register_observer` and :func:`set_default_state_hooks_provider`.
"""

from remat_dist.core._checkpoint import (
    checkpoint,
    name_scope,
    recompute_needs_tensor,
    region,
)
from remat_dist.core._hooks import (
    current_saved_tensor_info,
    save_for_backward,
    saved_tensors_hooks,
)
from remat_dist.core._placeholder import is_placeholder
from remat_dist.core._record import (
    CheckpointObserver,
    CheckpointRecord,
    RegionRecord,
    live_records,
    register_observer,
    set_default_state_hooks_provider,
)
from remat_dist.core._state import is_recomputing
from remat_dist.core._types import RecomputeStateHook, SavedTensorInfo, SavedTensorKind
from remat_dist.core.scope import active_scope_depth, gradient_checkpoint_scope

__all__ = [
    "CheckpointObserver",
    "CheckpointRecord",
    "RecomputeStateHook",
    "RegionRecord",
    "SavedTensorInfo",
    "SavedTensorKind",
    "checkpoint",
    "active_scope_depth",
    "current_saved_tensor_info",
    "gradient_checkpoint_scope",
    "is_placeholder",
    "is_recomputing",
    "live_records",
    "name_scope",
    "recompute_needs_tensor",
    "region",
    "register_observer",
    "save_for_backward",
    "saved_tensors_hooks",
    "set_default_state_hooks_provider",
]
