"""``apply_remat``: checkpoint blocks of a model in place, without wrapper modules.

How it composes with FSDP2 and tensor parallelism
-------------------------------------------------
``apply_remat`` replaces ``forward`` *on the block instance* with a method that runs
the class's (or the previous instance) forward inside
``remat_dist.checkpoint(region_name=<qualified name>, ...)``. ``nn.Module.__call__``
looks ``forward`` up on the instance, so everything registered as a module hook
stays *outside* the checkpoint:

* ``fully_shard`` swaps the block's class to an ``FSDP<Block>`` subclass (the
  instance ``forward`` still wins) and registers a forward pre-hook (all-gather the
  parameters, attach the post-backward reduce-scatter to the inputs) and a forward
  hook (reshard, attach the pre-backward all-gather to the outputs). The replay in
  backward calls the inner forward directly, after FSDP's pre-backward hook has
  unsharded the parameters, so remat adds no all-gather and no reduce-scatter.
* tensor-parallel styles (``parallelize_module``) hook the *submodules*; their
  collectives run inside the checkpoint and are replayed as the checkpoint's
  ``collectives=`` mode says. Block-level hooks (``shard_model``'s
  sequence-parallel slicing and gathering) stay outside.

Policy regions (``{"attention": "save"}``) replace the submodule's ``_call_impl``
on the instance instead (``nn.Module.__call__`` dispatches through it), so the
region covers the whole module call, hooks included; where that is not possible
(a submodule compiled with ``module.compile()``) its ``forward`` is replaced.

Because nothing is wrapped and no class changes, module types, parameter names and
``state_dict`` keys are exactly those of the model without remat, and the result is
the same whichever of ``apply_remat`` / ``shard_model`` runs first.

Where the rest lives: the policy language in ``_policy``, the refusals in
``_checks``, the patches in ``_patch``, the one installer every change goes through
in ``_install``, policies decided at run time (``MemoryBudget``) behind
``_planned``, and models of known libraries behind ``_adapters``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from remat_dist._errors import RematUsageError
from remat_dist._logging import get_logger
from remat_dist._torch import _dynamo
from remat_dist._torch._module import is_compiled
from remat_dist.core import CollectiveMode, RecomputeStateHook
from remat_dist.distributed import join_agreements
from remat_dist.wrap._adapters import adapter_for
from remat_dist.wrap._blocks import BlockSelector, select_blocks
from remat_dist.wrap._checks import check_blocks
from remat_dist.wrap._install import BlockInstaller
from remat_dist.wrap._patch import (
    BLOCK_ATTR,
    REGION_ATTR,
    BlockRemat,
    blocks_with_live_graphs,
    uninstall,
)
from remat_dist.wrap._planned import PLANNER_ATTR, PlannedPolicy
from remat_dist.wrap._policy import RematPolicy, resolve_policy

__all__ = ["apply_remat", "checkpointed_blocks", "remove_remat"]

STEP_HOOK_ATTR = "_remat_dist_step_hook"
"""On the model: the handle of the pre-hook that calls ``join_agreements()``."""

SELECTED_ATTR = "_remat_dist_selected"
"""On the model: every block ``apply_remat`` selected, checkpointed or not."""

PREPARED_ATTR = "_remat_dist_prepared"
"""On the model: the calls that undo what model adapters prepared (``_adapters``)."""

log = get_logger(__name__)


def apply_remat(
    model: nn.Module,
    *,
    blocks: BlockSelector | None = None,
    policy: RematPolicy = "full",
    recompute_state_hooks: Sequence[RecomputeStateHook] | None = None,
    collectives: CollectiveMode = "replay",
    determinism_check: str = "metadata",
) -> nn.Module:
    """Checkpoint each matching block of ``model`` in place; returns ``model``.

    Args:
        model: the model (plain, tensor-parallel, FSDP2-sharded or both: the order
            relative to :func:`shard_model` does not matter).
        blocks: module classes, a predicate ``(qualified_name, module) -> bool``,
            or fully qualified names. None (the default) only for a model whose
            library remat_dist knows: a transformers ``PreTrainedModel`` (its
            decoder layers, see ``remat_dist.integrations.transformers``).
        policy: what each checkpoint keeps: ``"full"``, ``"none"``,
            ``{"attention": "save"}``, ``{"every": k}`` / ``k``, a callable per
            block, or a :class:`MemoryBudget` (profile the first step, then keep
            what fits the budget at the least recompute time).
        recompute_state_hooks: ``recompute_state_hooks`` of every checkpoint
            (None: the checkpoint's default set, this rank's RNG with a process
            group, the CPU generator in one process; ``()``: none).
        collectives: the checkpoints' ``collectives`` mode (``"replay"``,
            ``"save"``).
        determinism_check: the checkpoints' ``determinism_check``
            (``"metadata"``, ``"metadata_per_tensor"`` or ``"values"``).

    The block's qualified name is its checkpoint's ``region_name``. Module types,
    parameter names and ``state_dict`` keys are unchanged; :func:`remove_remat`
    undoes it. A transformers model is also made safe to recompute, as its own
    gradient checkpointing does: while gradients are enabled it runs with
    ``use_cache=False`` (a warning says so when its config has the cache on), and a
    ``MemoryBudget`` without ``regions`` takes its attention and MLP.

    Returns:
        ``model``, changed in place (:func:`~remat_dist.wrap.checkpointed_blocks` says
        what was checkpointed).

    Raises:
        RematUsageError: a block already checkpointed (naming it), selected
            blocks that nest, a block containing FSDP units or a
            ``CheckpointWrapper`` (or with transformers' own checkpointing on),
            a policy naming missing submodules, or ``blocks`` missing for a model
            remat_dist does not know.

    Example::

        >>> remat_dist.apply_remat(model, blocks=Block, policy={"attention": "save"})
        >>> remat_dist.apply_remat(other, blocks=Block,
        ...                        policy=remat_dist.MemoryBudget(bytes="2GiB"))
    """
    if not isinstance(model, nn.Module):
        raise RematUsageError(
            f"remat_dist.apply_remat: model must be an nn.Module, got "
            f"{type(model).__name__}."
        )
    adapter = adapter_for(model)
    if blocks is None:
        if adapter is None:
            raise RematUsageError(
                f"remat_dist.apply_remat: blocks= is required for "
                f"{type(model).__name__} (only a transformers PreTrainedModel's "
                "blocks are found by themselves). Fix: pass the block class, e.g. "
                "apply_remat(model, blocks=Block), its qualified names, or a "
                "predicate (qualified_name, module) -> bool."
            )
        blocks = adapter.blocks(model)
    hooks = None if recompute_state_hooks is None else tuple(recompute_state_hooks)
    selected = select_blocks(model, blocks, caller="apply_remat")
    check_blocks(model, selected)
    installer = BlockInstaller(
        list(selected), hooks, collectives, determinism_check,
        side_passes=None if adapter is None else (lambda: adapter.side_passes(model)),
    )
    planned = policy if isinstance(policy, PlannedPolicy) else None
    attach = None
    if planned is not None:
        # every block starts with full recompute; the planner decides later
        if planned.regions is None and adapter is not None:
            found = adapter.regions(model, selected)
            if found is not None:
                planned = planned.with_regions(found)
        if PLANNER_ATTR in model.__dict__:
            raise RematUsageError(
                "remat_dist.apply_remat: the model already has a planned policy (a "
                "MemoryBudget). Fix: call remat_dist.remove_remat(model) first."
            )
        attach = planned.planner(model, installer)  # refuses before any change
        plans: dict[str, dict[str, str] | None] = {name: {} for name, _ in selected}
    else:
        plans = {}
        for index, (name, module) in enumerate(selected):
            regions = resolve_policy(policy, index, name, module)
            if regions is not None:
                _check_free(name, module, regions)
                plans[name] = regions
    undo = adapter.prepare(model, selected) if adapter is not None else None
    try:
        _forget_compiled(model, "apply_remat")
        installer.install(plans)
        if attach is not None:
            model.__dict__[PLANNER_ATTR] = attach()
    except BaseException:
        if undo is not None:
            undo()
        raise
    if undo is not None:
        model.__dict__.setdefault(PREPARED_ATTR, []).append(undo)
    model.__dict__.setdefault(SELECTED_ATTR, []).extend(m for _, m in selected)
    if STEP_HOOK_ATTR not in model.__dict__:
        # A rank whose policy leaves blocks unchecked still takes part in the
        # agreements of its groups (so a rank-dependent policy raises there).
        model.__dict__[STEP_HOOK_ATTR] = model.register_forward_pre_hook(_join_agreements)
    _log_setup(model, selected, plans, policy, collectives)
    return model


def _log_setup(
    model: nn.Module,
    selected: Sequence[tuple[str, nn.Module]],
    plans: dict[str, dict[str, str] | None],
    policy: RematPolicy,
    collectives: CollectiveMode,
) -> None:
    """One info line per ``apply_remat`` call: what it set up on this rank."""
    if not log.isEnabledFor(20):  # INFO
        return
    kinds = sorted({type(m).__name__ for _, m in selected})
    kept = sorted({r for p in plans.values() if p for r, d in p.items() if d == "save"})
    what = (
        f"policy {policy!r}"
        if isinstance(policy, (str, int, dict))
        else f"policy {type(policy).__name__}"
    )
    log.info(
        "apply_remat(%s): %d of %d selected blocks (%s) checkpointed, %s%s, "
        "collectives=%s",
        type(model).__name__,
        len(plans),
        len(selected),
        ", ".join(kinds),
        what,
        f" (save regions kept: {', '.join(kept)})" if kept else "",
        collectives,
    )


def _check_free(name: str, module: nn.Module, regions: dict[str, str]) -> None:
    for path in regions:
        sub = module.get_submodule(path)
        if REGION_ATTR in sub.__dict__:
            owner = sub.__dict__[REGION_ATTR].block
            raise RematUsageError(
                f"remat_dist.apply_remat: submodule {name}.{path} is already a "
                f"region of block {owner!r} (a module shared between blocks?). "
                "Fix: give each block its own submodule, or leave it out of the "
                "policy."
            )


def _join_agreements(module: nn.Module, args: Any) -> None:
    """A rank whose policy leaves a selected block unchecked takes part in the
    agreements of the groups its forward uses (its peers may checkpoint that block).
    Where every block is checkpointed, the checkpoints form their replay groups
    themselves, and nothing else is looked at: FSDP2's collectives pass untouched."""
    if torch.is_grad_enabled() and any(
        BLOCK_ATTR not in b.__dict__ for b in module.__dict__.get(SELECTED_ATTR, ())
    ):
        join_agreements()


def remove_remat(model: nn.Module) -> nn.Module:
    """Undo every :func:`apply_remat` on ``model`` (blocks and policy regions).

    Args:
        model: the model; one that ``apply_remat`` never touched is returned as is.

    Returns:
        ``model``, with its blocks' own ``forward`` back.

    Raises:
        RematUsageError: a graph built through a checkpointed block is alive (its
            backward would replay the block without the regions its forward ran):
            run that backward, or drop its outputs, first.

    Example::

        >>> remat_dist.apply_remat(model, blocks=Block)
        >>> remat_dist.remove_remat(model)
        >>> remat_dist.wrap.checkpointed_blocks(model)
        {}
    """
    live = blocks_with_live_graphs(model.modules())
    if live:
        shown = ", ".join(repr(n) for n in live[:4]) + (", ..." if len(live) > 4 else "")
        raise RematUsageError(
            f"remat_dist.remove_remat: {len(live)} checkpointed block(s) ({shown}) "
            "have a forward whose graph is still alive (not backpropagated yet, or "
            "kept with retain_graph=True). Its backward replays each block as its "
            "forward ran it, which needs the checkpoint and regions this would "
            "remove. Fix: run that backward (or drop the loss and outputs) before "
            "remove_remat(model)."
        )
    model.__dict__.pop(SELECTED_ATTR, None)
    hook = model.__dict__.pop(STEP_HOOK_ATTR, None)
    if hook is not None:
        hook.remove()
    planner = model.__dict__.pop(PLANNER_ATTR, None)
    if planner is not None:
        planner.detach()
    for undo in reversed(model.__dict__.pop(PREPARED_ATTR, [])):
        undo()  # what a model adapter prepared (transformers: the cache hooks)
    for _, module in model.named_modules():
        uninstall(module)
    _forget_compiled(model, "remove_remat")
    return model


def _forget_compiled(model: nn.Module, caller: str) -> None:
    """Drop Dynamo's compiled graphs if a module of ``model`` was compiled
    (``module.compile()``): they hold the previous plan, and Dynamo does not guard
    on the per-instance ``_call_impl`` through which a policy region runs, so the
    next call would reuse them. ``torch._dynamo.reset()`` is process-wide; the next
    call of every compiled function recompiles."""
    compiled = [
        n or "<model>"
        for n, m in model.named_modules()
        if is_compiled(m)
    ]
    if compiled:
        log.info(
            "%s: %d compiled module(s) (%s) change plan: torch._dynamo.reset(), "
            "the next call recompiles",
            caller,
            len(compiled),
            ", ".join(compiled[:3]) + (", ..." if len(compiled) > 3 else ""),
        )
        _dynamo.reset()


def checkpointed_blocks(model: nn.Module) -> dict[str, BlockRemat]:
    """What :func:`~remat_dist.apply_remat` checkpointed in ``model``.

    Args:
        model: the model.

    Returns:
        ``{qualified name: BlockRemat}``, in module order; empty when nothing is
        checkpointed.

    Example::

        >>> remat_dist.apply_remat(model, blocks=Block, policy={"attention": "save"})
        >>> blocks = remat_dist.wrap.checkpointed_blocks(model)
        >>> blocks["layers.0"].regions
        {'attention': 'save'}
    """
    return {
        name: module.__dict__[BLOCK_ATTR]
        for name, module in model.named_modules()
        if BLOCK_ATTR in module.__dict__
    }


def checkpointed_names(model: nn.Module) -> list[str]:
    """Qualified names of the checkpointed blocks (for ``shard_model``'s checks)."""
    return list(checkpointed_blocks(model))
