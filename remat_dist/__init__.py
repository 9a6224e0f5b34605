"""remat_dist: activation checkpointing that is aware of distributed training.

``import remat_dist as remat`` gives the whole public API (docs/api.md lists it):
torch_remat's region model (``checkpoint``, ``region``, ``recompute_needs_tensor``,
...), RETURNN's ``gradient_checkpoint_scope``, and the rank-aware pieces from
``remat_dist.distributed`` re-exported here. This package is the composition root:
importing it attaches the distributed layer to the core (the core itself installs
nothing).
"""

import remat_dist._logging  # noqa: F401  (quiet by default; REMAT_DIST_LOG=info)
import remat_dist.distributed as _distributed
from remat_dist.core import (
    RecomputeStateHook,
    SavedTensorInfo,
    SavedTensorKind,
    checkpoint,
    current_saved_tensor_info,
    gradient_checkpoint_scope,
    is_placeholder,
    is_recomputing,
    name_scope,
    recompute_needs_tensor,
    region,
    save_for_backward,
    saved_tensors_hooks,
)
from remat_dist.distributed import (
    CPURNGStateHook,
    DeviceRNGStateHook,
    DTensorRNGStateHook,
    GeneratorStateHook,
    check_plan_consistency,
    default_state_hooks,
    mark_step,
    set_replay_timeout,
)
from remat_dist.errors import (
    CollectiveReplayError,
    PlaceholderAccessError,
    PlanMismatchError,
    RematError,
    RematUsageError,
    ReplayMismatchError,
)
from remat_dist.fsdp import (
    MemoryBudget,
    TensorParallelPlan,
    apply_remat,
    current_plan,
    reference_tp_plan,
    remat_plan,
    remove_remat,
    shard_model,
)
from remat_dist.fsdp._adapters import register_model_adapter as _register_model_adapter
from remat_dist.integrations.transformers import ADAPTER as _transformers_adapter
from remat_dist.report import (
    CrossRankReport,
    attach_oom_observer,
    clear_memory_snapshot_cache,
    collect_trace,
    discover_autograd_roots,
    format_current_memory_report,
    format_oom_saved_tensors_report,
    format_saved_tensors_report,
    gather_saved_tensors_report,
    memory_snapshot_annotate,
    oom_observer,
    print_current_memory_report,
    print_saved_tensors_report,
    saved_tensors_summary,
    trace_scope,
)

# apply_remat knows transformers models (their decoder layers, use_cache off while
# recomputing) through the fsdp layer's model-adapter seam; the adapter imports
# transformers lazily, so this works without it installed.
_register_model_adapter(_transformers_adapter)

# The API contract lists the cross-rank report under remat_dist.distributed too
# (docs/api_contract.md). It is built
# in remat_dist.report, a layer above; this composition root, which imports both,
# attaches it there, so no import points upward.
_distributed.CrossRankReport = CrossRankReport
_distributed.gather_saved_tensors_report = gather_saved_tensors_report

__version__ = "0.1.0"

__all__ = [
    "check_plan_consistency",
    "set_replay_timeout",
    "mark_step",
    "MemoryBudget",
    "TensorParallelPlan",
    "apply_remat",
    "current_plan",
    "reference_tp_plan",
    "remat_plan",
    "remove_remat",
    "shard_model",
    "CrossRankReport",
    "attach_oom_observer",
    "clear_memory_snapshot_cache",
    "collect_trace",
    "discover_autograd_roots",
    "format_current_memory_report",
    "format_oom_saved_tensors_report",
    "format_saved_tensors_report",
    "gather_saved_tensors_report",
    "memory_snapshot_annotate",
    "oom_observer",
    "print_current_memory_report",
    "print_saved_tensors_report",
    "saved_tensors_summary",
    "trace_scope",
    "CPURNGStateHook",
    "DTensorRNGStateHook",
    "DeviceRNGStateHook",
    "GeneratorStateHook",
    "default_state_hooks",
    "CollectiveReplayError",
    "PlaceholderAccessError",
    "PlanMismatchError",
    "RecomputeStateHook",
    "RematError",
    "RematUsageError",
    "ReplayMismatchError",
    "SavedTensorInfo",
    "SavedTensorKind",
    "checkpoint",
    "current_saved_tensor_info",
    "gradient_checkpoint_scope",
    "is_placeholder",
    "is_recomputing",
    "name_scope",
    "recompute_needs_tensor",
    "region",
    "save_for_backward",
    "saved_tensors_hooks",
]
