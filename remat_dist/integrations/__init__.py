"""Adapters that put remat_dist in place of another framework's activation
checkpointing.

Each adapter lives in its own module and imports its framework lazily (inside
functions only), so ``import remat_dist.integrations.<name>`` works whether or not
that framework is installed:

``remat_dist.integrations.torchtitan``
    reads torchtitan's activation-checkpoint config (``full``, ``selective`` with
    ``"op"`` or a layer frequency, ``none``) and checkpoints the transformer blocks
    with :func:`remat_dist.apply_remat`, keeping the MoE load-balancing token
    counts equal to a run without checkpointing. docs/torchtitan.md is the recipe.

``remat_dist.integrations.transformers``
    makes ``apply_remat(model)`` work on a Hugging Face transformers
    ``PreTrainedModel``: finds its decoder layers, their attention and MLP, and
    turns the KV cache off while gradients are enabled. docs/transformers.md.

The composition root (``import remat_dist``) attaches the transformers adapter to
``apply_remat`` (it imports transformers only when a model of it exists); import
the torchtitan adapter yourself when you use it.
"""

__all__: list[str] = []
