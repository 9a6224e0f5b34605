"""Adapters that put remat_dist in place of another framework's activation
checkpointing.

Each adapter lives in its own module and imports its framework lazily (inside
functions only), so ``import remat_dist.integrations.<name>`` works whether or not
that framework is installed:

``remat_dist.integrations.torchtitan``
    reads torchtitan's activation-checkpoint config (``full``, ``selective`` with
    ``"op"`` or a layer frequency, ``none``) and checkpoints the transformer blocks
    with :func:`remat_dist.fsdp.apply_remat`, keeping the MoE load-balancing token
    counts equal to a run without checkpointing. docs/torchtitan.md is the recipe.

Nothing here is imported by ``import remat_dist``; import the adapter you use.
"""

__all__: list[str] = []
