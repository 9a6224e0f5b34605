"""The single-process runtime: checkpoint, regions, placeholders, state hooks,
RETURNN's scope. Knows nothing of ranks.

Its user API (``checkpoint``, ``region``, ...) is published at ``remat_dist``.
What this front door publishes (``__all__``) is the **extension interface**, the
only way in for the layers above (``remat_dist.core._*`` is private to core, a lint
rule enforces it; ``docs/extending.md`` documents each piece):

* the per-checkpoint record: :class:`CheckpointRecord`, :class:`RegionRecord`,
  :class:`SavedEntry`, :class:`PersistedOutput`, :class:`CheckpointPhase`,
  :class:`RecordExtension`, :func:`live_records`, :class:`WeakRecords`;
* the observer seam: :class:`CheckpointObserver`, :func:`register_observer`,
  :func:`observers_suspended`;
* the option seam: :func:`declare_option`, :class:`OptionSpec`,
  :class:`CheckpointOptions`;
* the default state hooks: :func:`set_default_state_hooks_provider`;
* the extent of saved-tensor hooks: :func:`set_saved_hooks_extent`;
* the running frame: :func:`current_frame`, :func:`active_scope_depth`;
* names of a call's arguments: :func:`positional_name`;
* what autograd holds: :func:`classify_packed`, :class:`PackedKind`,
  :func:`records_of_node`, :func:`live_scope_records`;
* storage identity: :func:`plain`, :func:`storage_key`, :func:`storage_nbytes`,
  :class:`StorageKey`;
* the value check (``determinism_check="values"``): :func:`values_check_enabled`,
  :func:`fingerprint`, :func:`fingerprints_differ`, :func:`raise_at_backward_end`.
"""

from remat_dist.core._arg_names import positional_name
from remat_dist.core._checkpoint import checkpoint as checkpoint
from remat_dist.core._fingerprint import (
    fingerprint,
    fingerprints_differ,
    raise_at_backward_end,
    values_check_enabled,
)
from remat_dist.core._hooks import (
    current_saved_tensor_info as current_saved_tensor_info,
)
from remat_dist.core._hooks import save_for_backward as save_for_backward
from remat_dist.core._hooks import saved_tensors_hooks as saved_tensors_hooks
from remat_dist.core._observers import observers_suspended, register_observer
from remat_dist.core._options import CheckpointOptions, OptionSpec, declare_option
from remat_dist.core._packed import PackedKind, classify_packed, records_of_node
from remat_dist.core._placeholder import is_placeholder as is_placeholder
from remat_dist.core._record import (
    CheckpointObserver,
    CheckpointPhase,
    CheckpointRecord,
    PersistedOutput,
    RecordExtension,
    RegionRecord,
    SavedEntry,
    WeakRecords,
    live_records,
    set_default_state_hooks_provider,
    set_saved_hooks_extent,
)
from remat_dist.core._region import name_scope as name_scope
from remat_dist.core._region import recompute_needs_tensor as recompute_needs_tensor
from remat_dist.core._region import region as region
from remat_dist.core._scope import active_scope_depth, live_scope_records
from remat_dist.core._scope import (
    gradient_checkpoint_scope as gradient_checkpoint_scope,
)
from remat_dist.core._state import current_frame
from remat_dist.core._state import is_recomputing as is_recomputing
from remat_dist.core._storage import StorageKey, plain, storage_key, storage_nbytes
from remat_dist.core._types import CollectiveMode as CollectiveMode
from remat_dist.core._types import RecomputeStateHook as RecomputeStateHook
from remat_dist.core._types import SavedTensorInfo as SavedTensorInfo
from remat_dist.core._types import SavedTensorKind as SavedTensorKind

__all__ = [
    "CheckpointObserver",
    "CheckpointOptions",
    "CheckpointPhase",
    "CheckpointRecord",
    "OptionSpec",
    "PackedKind",
    "PersistedOutput",
    "RecordExtension",
    "RegionRecord",
    "SavedEntry",
    "StorageKey",
    "WeakRecords",
    "active_scope_depth",
    "classify_packed",
    "current_frame",
    "declare_option",
    "fingerprint",
    "fingerprints_differ",
    "live_records",
    "live_scope_records",
    "observers_suspended",
    "plain",
    "positional_name",
    "raise_at_backward_end",
    "records_of_node",
    "register_observer",
    "set_default_state_hooks_provider",
    "set_saved_hooks_extent",
    "storage_key",
    "storage_nbytes",
    "values_check_enabled",
]
