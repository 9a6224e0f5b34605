"""remat_dist: activation checkpointing that is aware of distributed training.

``import remat_dist as remat`` gives torch_remat 0.2's names (the drop-in
contract) and the few of remat_dist's own that a training script calls:
``apply_remat``, ``shard_model``, ``MemoryBudget``, the cross-rank report and the
two base errors. The rest is in named modules: ``remat_dist.wrap`` (what
``apply_remat`` did), ``remat_dist.shard`` (tensor-parallel plans),
``remat_dist.budget`` (the budget's chosen plan), ``remat_dist.distributed``
(replay across ranks, RNG state hooks), ``remat_dist.report`` (report objects),
``remat_dist.errors`` (every error kind), and at the side ``remat_dist.testing``,
``remat_dist.models``, ``remat_dist.integrations`` and ``remat_dist.compat``.
``docs/api.md`` lists them all.

This package is also the composition root: importing it attaches the distributed
layer to the core (the core itself installs nothing) and the transformers adapter
to the wrapping layer.
"""

import warnings as _warnings

import remat_dist._logging  # noqa: F401  (quiet by default; REMAT_DIST_LOG=info)
import remat_dist.errors  # noqa: F401  (remat_dist.errors.X works after import remat_dist)
from remat_dist._errors import RematError, RematUsageError
from remat_dist.budget import MemoryBudget
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
from remat_dist.integrations.transformers import ADAPTER as _transformers_adapter
from remat_dist.report import add_rank_section as _add_rank_section
from remat_dist.report import (
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
    trace_scope,
)
from remat_dist.shard import shard_model
from remat_dist.wrap import apply_remat, register_model_adapter, remove_remat

# apply_remat knows transformers models (their decoder layers, use_cache off while
# recomputing) through the wrapping layer's model-adapter seam; the adapter imports
# transformers lazily, so this works without it installed.
register_model_adapter(_transformers_adapter)

# the cross-rank report shows each rank's memory budgets (peak, plans) through
# the report's rank-section seam: the report layer may not import the budget's
_add_rank_section("budget", _budget_rank_summary)

__version__ = "0.1.0"

__all__ = [
    # torch_remat 0.2's names (the drop-in contract): regions and checkpoints
    "checkpoint",
    "region",
    "recompute_needs_tensor",
    "save_for_backward",
    "is_recomputing",
    "is_placeholder",
    "RecomputeStateHook",
    "saved_tensors_hooks",
    "current_saved_tensor_info",
    "SavedTensorInfo",
    "SavedTensorKind",
    # torch_remat 0.2's names: traces and reports
    "collect_trace",
    "trace_scope",
    "format_saved_tensors_report",
    "print_saved_tensors_report",
    "format_current_memory_report",
    "print_current_memory_report",
    "discover_autograd_roots",
    "oom_observer",
    "format_oom_saved_tensors_report",
    "memory_snapshot_annotate",
    "clear_memory_snapshot_cache",
    # remat_dist's own: scopes
    "name_scope",
    "gradient_checkpoint_scope",
    "CollectiveMode",
    # remat_dist's own: models
    "apply_remat",
    "remove_remat",
    "shard_model",
    "MemoryBudget",
    # remat_dist's own: the cross-rank report
    "gather_saved_tensors_report",
    # remat_dist's own: errors (the other kinds are in remat_dist.errors)
    "RematError",
    "RematUsageError",
]

TORCH_REMAT_NAMES = frozenset(__all__[:22])
"""torch_remat 0.2's top-level names, all kept here (the drop-in contract)."""

MOVED = {
    "remat_plan": "remat_dist.wrap.checkpointed_blocks",
    "BlockRemat": "remat_dist.wrap.BlockRemat",
    "reference_tp_plan": "remat_dist.shard.reference_tp_plan",
    "TensorParallelPlan": "remat_dist.shard.TensorParallelPlan",
    "current_plan": "remat_dist.budget.current_plan",
    "BudgetPlan": "remat_dist.budget.BudgetPlan",
    "BlockPlan": "remat_dist.budget.BlockPlan",
    "set_replay_timeout": "remat_dist.distributed.set_replay_timeout",
    "mark_step": "remat_dist.distributed.join_agreements",
    "check_plan_consistency": "remat_dist.distributed.check_plan_consistency",
    "step_stats": "remat_dist.distributed.step_stats",
    "StepStats": "remat_dist.distributed.StepStats",
    "default_state_hooks": "remat_dist.distributed.default_state_hooks",
    "DeviceRNGStateHook": "remat_dist.distributed.DeviceRNGStateHook",
    "CPURNGStateHook": "remat_dist.distributed.CPURNGStateHook",
    "DTensorRNGStateHook": "remat_dist.distributed.DTensorRNGStateHook",
    "GeneratorStateHook": "remat_dist.distributed.GeneratorStateHook",
    "Trace": "remat_dist.report.Trace",
    "saved_tensors_summary": "remat_dist.report.saved_tensors_summary",
    "CrossRankReport": "remat_dist.report.CrossRankReport",
    "attach_oom_observer": "remat_dist.report.attach_oom_observer",
    "PlaceholderAccessError": "remat_dist.errors.PlaceholderAccessError",
    "ReplayMismatchError": "remat_dist.errors.ReplayMismatchError",
    "ReplayValueMismatchError": "remat_dist.errors.ReplayValueMismatchError",
    "CollectiveReplayError": "remat_dist.errors.CollectiveReplayError",
    "PlanMismatchError": "remat_dist.errors.PlanMismatchError",
    "AgreementSetupError": "remat_dist.errors.AgreementSetupError",
}
"""Names that left the top level in 0.1.0 -> where they are now
(``module.name``). The old spelling still works, with a ``DeprecationWarning``,
until 0.2.0."""


def __getattr__(name: str):
    if name not in MOVED:
        raise AttributeError(f"module 'remat_dist' has no attribute {name!r}")
    import importlib

    module, new = MOVED[name].rsplit(".", 1)
    _warnings.warn(
        f"remat_dist.{name} moved to {module}.{new}; the top-level name is "
        f"deprecated and goes in remat_dist 0.2.0 (write: from {module} import {new})",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), new)
