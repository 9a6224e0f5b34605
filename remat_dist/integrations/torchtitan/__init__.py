"""remat_dist in place of torchtitan's activation checkpointing.

torchtitan checkpoints each child of ``model.layers`` (its transformer blocks) with
torch's ``checkpoint_wrapper``, chosen by its activation-checkpoint config. This
adapter reads the same config and checkpoints the same blocks with
:func:`remat_dist.apply_remat` instead, so a torchtitan job keeps its command
line and gets remat_dist's per-rank RNG replay, collective checks and reports.
docs/torchtitan.md is the step-by-step recipe.

torchtitan is imported lazily (only inside the functions that need it): importing
this module works without torchtitan installed, and :func:`apply_ac` runs on any
model shaped like torchtitan's (a ``layers`` container of blocks).

How the config maps
-------------------
Both shapes torchtitan has used are read (:func:`read_ac_config`):

* the older ``ActivationCheckpoint`` job config with ``mode`` (``"none"``,
  ``"full"``, ``"selective"``, ``"memory_budget"``) and ``selective_ac_option``
  (``"op"`` or a layer frequency such as ``"2"``);
* the newer policy configs (``FullAC.Config``, ``SelectiveAC.Config``,
  ``MemoryBudgetAC.Config`` or ``None``), or a policy built from one.

===================================  ==========================================
torchtitan                           remat_dist
===================================  ==========================================
``full``                             every block, ``policy="full"``
``selective``, option ``"k"`` (int)  every k-th block counting from 1 (blocks
                                     ``k-1, 2k-1, ...``; ``"0"``: every block),
                                     ``policy="full"``, as torchtitan's layer SAC
``selective``, option ``"op"``       every block, ``op_policy`` (default
                                     ``{"attention": "save"}``: keep attention's
                                     activations, recompute the rest). remat_dist
                                     selects by module region, not by aten op.
``preserve_rng_state=True``          ``recompute_state_hooks=None`` (the default
                                     per-rank RNG hooks: dropout replays exactly)
``preserve_rng_state=False``         ``recompute_state_hooks=()`` (a warning names
                                     any ``nn.Dropout`` in the blocks)
``determinism_check``                passed through (``"default"`` / ``"none"``)
``debug``, ``early_stop``            not applied (a warning names them when set)
``none`` / ``None``                  refused: :class:`RematUsageError`
``memory_budget``                    refused: it is a compiler option, no
                                     checkpoint is placed
===================================  ==========================================

When it would checkpoint nothing (mode ``none``, a config of ``None``, a layer
frequency larger than the number of blocks, a model without ``layers``),
:func:`apply_ac` *refuses* with a :class:`RematUsageError` instead of returning a
model without checkpointing: a job that asks for remat_dist and silently trains
without it measures the wrong thing. Leave the adapter out to train without AC.

MoE load-balancing token counts
-------------------------------
torchtitan's ``MoE`` adds each forward's per-expert token counts to a buffer
(``tokens_per_expert_E``; ``tokens_per_expert`` in older releases), and a
recomputed block adds them a second time. torchtitan corrects that in its
optimizer pre-hook by halving the counts of blocks whose ``checkpoint_impl`` is
``CheckpointImpl.NO_REENTRANT`` (the attribute of torch's ``CheckpointWrapper``).
Halving is right only when every forward is replayed exactly once, which
remat_dist does not promise (a ``"save"`` region is skipped on replay). So the
adapter does not set ``checkpoint_impl``; it installs a *count guard* on each
module inside a checkpointed block that holds such a buffer: while remat_dist
replays (:func:`remat_dist.is_recomputing`), that module's counts go to a scratch
tensor that is dropped afterwards (also when torch's early stop ends the replay
inside it). The buffer then holds exactly what the forward passes counted, as
without checkpointing, and torchtitan's halving stays off.

With torchtitan's override mechanism
------------------------------------
Importing this module while torchtitan's config package is loaded (which is the
case when torchtitan imports it for ``--override.imports``) registers
:func:`remat_activation_checkpoint` as an override of torchtitan's
``ActivationCheckpointing.Config``; :func:`register_torchtitan_override` does it
explicitly. See docs/torchtitan.md.
"""

from remat_dist.integrations.torchtitan._apply import (
    apply_ac,
    patch_apply_ac,
    remove_ac,
    selected_blocks,
)
from remat_dist.integrations.torchtitan._config import (
    COUNTER_BUFFERS,
    DEFAULT_OP_POLICY,
    ACSettings,
    read_ac_config,
)
from remat_dist.integrations.torchtitan._guards import guarded_counters
from remat_dist.integrations.torchtitan._override import (
    register_torchtitan_override,
    remat_activation_checkpoint,
)

__all__ = [
    "ACSettings",
    "COUNTER_BUFFERS",
    "DEFAULT_OP_POLICY",
    "apply_ac",
    "guarded_counters",
    "patch_apply_ac",
    "read_ac_config",
    "register_torchtitan_override",
    "remat_activation_checkpoint",
    "remove_ac",
    "selected_blocks",
]
