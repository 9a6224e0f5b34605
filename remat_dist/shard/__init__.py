"""Sharding a model for FSDP2 and tensor parallelism in torchtitan's order
(``shard_model``, the reference TP plan; published at ``remat_dist``), in either
order with ``apply_remat``::

    import remat_dist as remat
    from remat_dist.models import GPT, Block

    model = GPT(config)
    remat.apply_remat(model, blocks=Block, policy={"attention": "save"})
    remat.shard_model(model, mesh, blocks=Block, tp_plan=remat.reference_tp_plan())
"""

from remat_dist.shard._shard import (
    shard_model as shard_model,  # published at remat_dist
)
from remat_dist.shard._tp_plan import (
    TensorParallelPlan as TensorParallelPlan,  # published at remat_dist
)
from remat_dist.shard._tp_plan import (
    reference_tp_plan as reference_tp_plan,  # published at remat_dist
)

__all__: list[str] = []
