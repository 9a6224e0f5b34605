"""remat_dist: activation checkpointing that is aware of distributed training.

``import remat_dist as remat`` is the one front door: every name a user calls or
receives is published here, and only here (``docs/api.md`` lists them). The
packages below are the layers (``core``, ``distributed``, ``wrap``, ``budget``,
``shard``, ``report``) and what sits at the side (``testing``, ``models``,
``integrations``, ``compat``); a layer's own ``__all__`` lists what the layers
above it use, never a name published here (``remat_dist.core``'s is the extension
interface, ``docs/extending.md``).

This package is also the composition root: importing it attaches the distributed
layer to the core (the core itself installs nothing) and the transformers adapter
to the wrapping layer.
"""

import remat_dist._logging  # noqa: F401  (quiet by default; REMAT_DIST_LOG=info)
from remat_dist._errors import (
    AgreementSetupError,
    CollectiveReplayError,
    PlaceholderAccessError,
    PlanMismatchError,
    RematError,
    RematUsageError,
    ReplayMismatchError,
    ReplayValueMismatchError,
)
from remat_dist.budget import BlockPlan, BudgetPlan, MemoryBudget, current_plan
from remat_dist.budget import rank_summary as _budget_rank_summary
from remat_dist.core import (
    CollectiveMode,
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
    StepStats,
    check_plan_consistency,
    default_state_hooks,
    mark_step,
    set_replay_timeout,
    step_stats,
)
from remat_dist.integrations.transformers import ADAPTER as _transformers_adapter
from remat_dist.report import (
    CrossRankReport,
    Trace,
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
from remat_dist.report import add_rank_section as _add_rank_section
from remat_dist.shard import TensorParallelPlan, reference_tp_plan, shard_model
from remat_dist.wrap import (
    BlockRemat,
    apply_remat,
    register_model_adapter,
    remat_plan,
    remove_remat,
)

# apply_remat knows transformers models (their decoder layers, use_cache off while
# recomputing) through the wrapping layer's model-adapter seam; the adapter imports
# transformers lazily, so this works without it installed.
register_model_adapter(_transformers_adapter)

# the cross-rank report shows each rank's memory budgets (peak, plans) through
# the report's rank-section seam: the report layer may not import the budget's
_add_rank_section("budget", _budget_rank_summary)

__version__ = "0.1.0"

__all__ = [
    # regions and checkpoints (torch_remat's model)
    "checkpoint",
    "region",
    "name_scope",
    "recompute_needs_tensor",
    "save_for_backward",
    "is_recomputing",
    "is_placeholder",
    "RecomputeStateHook",
    "saved_tensors_hooks",
    "current_saved_tensor_info",
    "SavedTensorInfo",
    "SavedTensorKind",
    # RETURNN's scope
    "gradient_checkpoint_scope",
    # models: wrapping, sharding, the memory budget
    "apply_remat",
    "remove_remat",
    "remat_plan",
    "BlockRemat",
    "shard_model",
    "reference_tp_plan",
    "TensorParallelPlan",
    "MemoryBudget",
    "current_plan",
    "BudgetPlan",
    "BlockPlan",
    # ranks: replay safety and RNG
    "CollectiveMode",
    "set_replay_timeout",
    "mark_step",
    "check_plan_consistency",
    "step_stats",
    "StepStats",
    "default_state_hooks",
    "DeviceRNGStateHook",
    "CPURNGStateHook",
    "DTensorRNGStateHook",
    "GeneratorStateHook",
    # traces and reports
    "collect_trace",
    "trace_scope",
    "Trace",
    "saved_tensors_summary",
    "format_saved_tensors_report",
    "print_saved_tensors_report",
    "gather_saved_tensors_report",
    "CrossRankReport",
    "discover_autograd_roots",
    "format_current_memory_report",
    "print_current_memory_report",
    "attach_oom_observer",
    "oom_observer",
    "format_oom_saved_tensors_report",
    "memory_snapshot_annotate",
    "clear_memory_snapshot_cache",
    # errors
    "RematError",
    "RematUsageError",
    "PlaceholderAccessError",
    "ReplayMismatchError",
    "CollectiveReplayError",
    "ReplayValueMismatchError",
    "PlanMismatchError",
    "AgreementSetupError",
]
