"""Wrapping utilities: checkpoint blocks (``apply_remat``) and shard the model with
FSDP2 and tensor parallelism (``shard_model``), in either order.

::

    import remat_dist as remat
    from remat_dist.fsdp import apply_remat, reference_tp_plan, shard_model
    from remat_dist.models import GPT, Block

    model = GPT(config)
    apply_remat(model, blocks=Block, policy={"attention": "save"})
    shard_model(model, mesh, blocks=Block, tp_plan=reference_tp_plan())

``apply_remat`` keeps module types, parameter names and ``state_dict`` keys: it
replaces ``forward`` on each block instance, so FSDP2's and TP's module hooks stay
outside the checkpoint and remat adds no parameter all-gather in backward.
"""

from remat_dist.fsdp._apply import BlockRemat, apply_remat, remat_plan, remove_remat
from remat_dist.fsdp._blocks import BlockSelector
from remat_dist.fsdp._budget import BlockPlan, BudgetPlan, MemoryBudget, current_plan
from remat_dist.fsdp._policy import RematPolicy
from remat_dist.fsdp._shard import shard_model
from remat_dist.fsdp._tp_plan import TensorParallelPlan, reference_tp_plan

__all__ = [
    "BlockPlan",
    "BlockRemat",
    "BlockSelector",
    "BudgetPlan",
    "MemoryBudget",
    "RematPolicy",
    "TensorParallelPlan",
    "apply_remat",
    "current_plan",
    "reference_tp_plan",
    "remat_plan",
    "remove_remat",
    "shard_model",
]
