"""Checkpointing a model's blocks in place: ``apply_remat`` and ``remove_remat``
(published at ``remat_dist``), :func:`checkpointed_blocks` and :class:`BlockRemat` (what
``apply_remat`` did, for users), and what the layers above use to
build on it: the block selector type, the policy type, the installer a planned
policy drives (``remat_dist.budget`` plugs in through :class:`PlannedPolicy`), the
model-adapter seam (``remat_dist.integrations``) and the checks ``shard_model``
shares.

``apply_remat`` keeps module types, parameter names and ``state_dict`` keys: it
replaces ``forward`` on each block instance, so FSDP2's and TP's module hooks stay
outside the checkpoint and remat adds no parameter all-gather in backward.
"""

from remat_dist.wrap._adapters import ModelAdapter, adapter_for, register_model_adapter
from remat_dist.wrap._apply import apply_remat as apply_remat  # published at remat_dist
from remat_dist.wrap._apply import checkpointed_blocks, checkpointed_names
from remat_dist.wrap._apply import (
    remove_remat as remove_remat,  # published at remat_dist
)
from remat_dist.wrap._blocks import BlockSelector, select_blocks, strictly_inside
from remat_dist.wrap._checks import check_no_fsdp_inside
from remat_dist.wrap._install import BlockInstaller, Regions
from remat_dist.wrap._patch import BLOCK_ATTR, REGION_ATTR, BlockRemat, call_block
from remat_dist.wrap._planned import PLANNER_ATTR, PlannedPolicy, Planner, planner_of
from remat_dist.wrap._policy import RematPolicy

__all__ = [
    # for users: what apply_remat did
    "checkpointed_blocks",
    "BlockRemat",
    # for the layers above (budget, shard, integrations)
    "BLOCK_ATTR",
    "PLANNER_ATTR",
    "REGION_ATTR",
    "BlockInstaller",
    "BlockSelector",
    "ModelAdapter",
    "PlannedPolicy",
    "Planner",
    "Regions",
    "RematPolicy",
    "adapter_for",
    "call_block",
    "check_no_fsdp_inside",
    "checkpointed_names",
    "planner_of",
    "register_model_adapter",
    "select_blocks",
    "strictly_inside",
]


def __getattr__(name: str):
    if name == "remat_plan":  # its name until 0.1.0
        import warnings

        warnings.warn(
            "remat_dist.wrap.remat_plan is deprecated and goes in remat_dist 0.2.0: "
            "use remat_dist.wrap.checkpointed_blocks (the same function; 'plan' is "
            "what a MemoryBudget chooses)",
            DeprecationWarning,
            stacklevel=2,
        )
        return checkpointed_blocks
    raise AttributeError(f"module 'remat_dist.wrap' has no attribute {name!r}")

