"""The single-process runtime: checkpoint, regions, placeholders, state hooks, scope.

Knows nothing of ranks. This front door is also the extension surface the layers
above use (and the only one: ``remat_dist.core._*`` is private to core, enforced by
a lint rule): the per-checkpoint record (:class:`CheckpointRecord`,
:class:`RegionRecord`, :class:`SavedEntry`), the observer seam
(:class:`CheckpointObserver`, :func:`register_observer`), the default state-hook
provider, the option seam (:func:`declare_option`, :class:`CheckpointOptions`) (:func:`set_default_state_hooks_provider`), the running frame
(:func:`current_frame`), the classifier of what autograd holds
(:func:`classify_packed`, :func:`records_of_node`) and storage identity
(:func:`plain`, :func:`storage_key`, :func:`storage_nbytes`).
"""

from remat_dist.core._checkpoint import checkpoint
from remat_dist.core._hooks import (
    current_saved_tensor_info,
    save_for_backward,
    saved_tensors_hooks,
)
from remat_dist.core._options import CheckpointOptions, OptionSpec, declare_option
from remat_dist.core._packed import PackedKind, classify_packed, records_of_node
from remat_dist.core._placeholder import is_placeholder
from remat_dist.core._record import (
    CheckpointObserver,
    CheckpointPhase,
    CheckpointRecord,
    PersistedOutput,
    RecordExtension,
    RegionRecord,
    SavedEntry,
    live_records,
    register_observer,
    set_default_state_hooks_provider,
)
from remat_dist.core._region import name_scope, recompute_needs_tensor, region
from remat_dist.core._state import current_frame, is_recomputing
from remat_dist.core._storage import StorageKey, plain, storage_key, storage_nbytes
from remat_dist.core._types import RecomputeStateHook, SavedTensorInfo, SavedTensorKind
from remat_dist.core.scope import active_scope_depth, gradient_checkpoint_scope

__all__ = [
    "CheckpointObserver",
    "CheckpointOptions",
    "CheckpointPhase",
    "CheckpointRecord",
    "OptionSpec",
    "PackedKind",
    "PersistedOutput",
    "RecomputeStateHook",
    "RecordExtension",
    "RegionRecord",
    "SavedEntry",
    "StorageKey",
    "SavedTensorInfo",
    "SavedTensorKind",
    "checkpoint",
    "active_scope_depth",
    "classify_packed",
    "current_frame",
    "current_saved_tensor_info",
    "declare_option",
    "gradient_checkpoint_scope",
    "is_placeholder",
    "is_recomputing",
    "live_records",
    "name_scope",
    "plain",
    "recompute_needs_tensor",
    "records_of_node",
    "region",
    "register_observer",
    "save_for_backward",
    "saved_tensors_hooks",
    "set_default_state_hooks_provider",
    "storage_key",
    "storage_nbytes",
]
