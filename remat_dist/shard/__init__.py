"""Sharding a model for FSDP2 and tensor parallelism in torchtitan's order.

``remat_dist.shard_model`` (published at the top level) applies a
:class:`TensorParallelPlan`, then FSDP2 per block and on the root, in either order
with ``apply_remat``; :func:`reference_tp_plan` is the plan for
``remat_dist.models.GPT``::

    import remat_dist as remat
    from remat_dist.models import GPT, Block
    from remat_dist.shard import reference_tp_plan

    model = GPT(config)
    remat.apply_remat(model, blocks=Block, policy={"attention": "save"})
    remat.shard_model(model, mesh, blocks=Block, tp_plan=reference_tp_plan())
"""

from remat_dist.shard._shard import (
    shard_model as shard_model,  # published at remat_dist
)
from remat_dist.shard._tp_plan import TensorParallelPlan, reference_tp_plan

__all__ = ["TensorParallelPlan", "reference_tp_plan"]
