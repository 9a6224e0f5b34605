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
the same whichever of ``apply_remat`` / ``shard_model`` runs first. What does not
compose, and is refused with a :class:`RematUsageError`, is a checkpointed block
that *contains* FSDP units (their all-gathers would run inside the checkpoint) or
another checkpoint.

Where the rest lives: the policy language (``"full"``, ``{"attention": "save"}``,
``{"every": k}``, callables) in ``remat_dist.fsdp._policy``; the instance patches
themselves (install, run, remove) in ``remat_dist.fsdp._patch``. This module holds
the checks that refuse a layout before anything changes, and the public calls.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat_dist._logging import get_logger
from remat_dist.core import CheckpointRecord, RecomputeStateHook, checkpoint
from remat_dist.distributed import mark_step
from remat_dist.errors import RematUsageError
from remat_dist.fsdp._adapters import adapter_for
from remat_dist.fsdp._blocks import BlockSelector, select_blocks, strictly_inside
from remat_dist.fsdp._budget import MemoryBudget, attach_budget, detach_budget
from remat_dist.fsdp._patch import (
    BLOCK_ATTR,
    REGION_ATTR,
    blocks_with_live_graphs,
    call_block,
    install_block,
    install_region,
    instance_forward,
    uninstall,
)
from remat_dist.fsdp._policy import RematPolicy, resolve_policy

__all__ = [
    "BlockRemat",
    "apply_remat",
    "remat_plan",
    "remove_remat",
]

STEP_HOOK_ATTR = "_remat_dist_step_hook"
"""On the model: the handle of the pre-hook that calls ``mark_step()``."""

SELECTED_ATTR = "_remat_dist_selected"
"""On the model: every block ``apply_remat`` selected, checkpointed or not."""

PREPARED_ATTR = "_remat_dist_prepared"
"""On the model: the calls that undo what model adapters prepared (``_adapters``)."""

log = get_logger(__name__)


@dataclass
class BlockRemat:
    """What :func:`apply_remat` did to one block (see :func:`remat_plan`).

    Attributes:
        name: the block's qualified name; also the checkpoint's ``region_name``.
        regions: ``{submodule path (relative to the block): "save" | "recompute"}``.
        state_hooks: the ``recompute_state_hooks`` given to the checkpoint (None:
            the checkpoint's default set).
        collectives: the checkpoint's ``collectives`` mode.
    """

    name: str
    regions: dict[str, str] = field(default_factory=dict)
    state_hooks: tuple[RecomputeStateHook, ...] | None = None
    collectives: str = "replay"
    previous_forward: Any = field(default=None, repr=False)
    """The instance ``forward`` the block had before (None: the class's)."""
    run: Any = field(default=None, repr=False)
    """The checkpointed ``(module, *args, **kwargs) -> out`` callable."""
    pending: weakref.WeakSet[CheckpointRecord] = field(
        default_factory=weakref.WeakSet, repr=False, compare=False
    )
    """The block's checkpoint records whose autograd graph is still alive: a
    backward through them would replay the block as its forward ran it."""
    replays: int = field(default=0, repr=False, compare=False)
    """How many replays of this block's checkpoint have run (a backward went
    through it, whatever tensor it started from)."""



def _nested_checkpoint_types() -> tuple[type, ...]:
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointWrapper,
        )
    except Exception:  # pragma: no cover - private path moved
        return ()
    return (CheckpointWrapper,)


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # pragma: no cover - very old torch
        return None
    return FSDPModule


def check_no_fsdp_inside(
    checkpointed: Sequence[str],
    fsdp_units: Sequence[str],
    *,
    fix: str,
) -> None:
    """Refuse checkpointed blocks that strictly contain FSDP units."""
    for outer in checkpointed:
        for inner in fsdp_units:
            if strictly_inside(outer, inner):
                raise RematUsageError(
                    f"remat_dist: checkpointed block {outer!r} contains the FSDP unit "
                    f"{inner!r}: its parameter all-gathers would run inside the "
                    "checkpoint and again on replay. Checkpoint the FSDP units (or "
                    f"modules inside them) instead. Fix: {fix}"
                )


def apply_remat(
    model: nn.Module,
    *,
    blocks: BlockSelector | None = None,
    policy: RematPolicy = "full",
    recompute_state_hooks: Sequence[RecomputeStateHook] | None = None,
    collectives: str = "replay",
    determinism_check: str = "none",
    state_hooks: Sequence[RecomputeStateHook] | None = None,
) -> nn.Module:
    """Checkpoint each matching block of ``model`` in place; returns ``model``.

    Args:
        model: the model (plain, tensor-parallel, FSDP2-sharded or both: the order
            relative to :func:`shard_model` does not matter).
        blocks: module classes, a predicate ``(qualified_name, module) -> bool``,
            or fully qualified names (see ``remat_dist.fsdp._blocks``). None (the
            default) only for a model whose library remat_dist knows: a
            transformers ``PreTrainedModel`` (its decoder layers, see
            ``remat_dist.integrations.transformers``).
        policy: what each checkpoint keeps (see ``remat_dist.fsdp._policy``):
            ``"full"``, ``{"attention": "save"}``, ``{"every": k}`` / ``k``, a
            callable, or a :class:`MemoryBudget` (profile the first step, then
            keep what fits the budget at the least recompute time; see
            ``remat_dist.fsdp._budget``).
        recompute_state_hooks: ``recompute_state_hooks`` of every checkpoint
            (None: the checkpoint's default set, this rank's RNG with a process
            group, the CPU generator in one process; ``()``: none).
        collectives: the checkpoints' ``collectives`` mode (``"replay"``,
            ``"save"``).
        determinism_check: the checkpoints' ``determinism_check``.
        state_hooks: deprecated name of ``recompute_state_hooks`` (one name per
            concept across the API); warns, and goes in the next release.

    The block's qualified name is its checkpoint's ``region_name``. Module types,
    parameter names and ``state_dict`` keys are unchanged; :func:`remove_remat`
    undoes it. A transformers model is also made safe to recompute, as its own
    gradient checkpointing does: while gradients are enabled it runs with
    ``use_cache=False`` (a warning says so when its config has the cache on), and a
    ``MemoryBudget`` without ``regions`` takes its attention and MLP. Raises
    :class:`RematUsageError` when a block is already checkpointed (naming it),
    when selected blocks nest, when a block contains FSDP units or a
    ``CheckpointWrapper`` (or has transformers' own checkpointing on), when the
    policy names missing submodules, or when ``blocks`` is missing for a model
    remat_dist does not know.
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
    if state_hooks is not None:
        if recompute_state_hooks is not None:
            raise RematUsageError(
                "remat_dist.apply_remat: pass recompute_state_hooks only (state_hooks "
                "is its deprecated name)."
            )
        warnings.warn(
            "remat_dist.apply_remat(state_hooks=...) is deprecated: pass "
            "recompute_state_hooks=... (the name checkpoint uses).",
            DeprecationWarning,
            stacklevel=2,
        )
        recompute_state_hooks = state_hooks
    hooks = None if recompute_state_hooks is None else tuple(recompute_state_hooks)
    selected = select_blocks(model, blocks, caller="apply_remat")
    all_named = list(model.named_modules())
    already = [n for n, m in all_named if BLOCK_ATTR in m.__dict__]
    selected_names = [n for n, _ in selected]
    for name, module in selected:
        if BLOCK_ATTR in module.__dict__:
            raise RematUsageError(
                f"remat_dist.apply_remat: block {name!r} is already checkpointed by an "
                "earlier apply_remat call. Fix: apply it once, or call "
                "remat_dist.fsdp.remove_remat(model) first to change the policy."
            )
        for other in already + selected_names:
            if strictly_inside(name, other):
                outer, inner = name, other
            elif strictly_inside(other, name):
                outer, inner = other, name
            else:
                continue
            raise RematUsageError(
                f"remat_dist.apply_remat: block {inner!r} lies inside block "
                f"{outer!r}, and both would be checkpointed; nested checkpoints "
                "are not supported. Fix: select one level of blocks, or keep the "
                "inner one as a policy entry ({'sub': 'save'})."
            )
    for name, module in selected:
        if (
            type(module).forward is nn.Module.forward
            and "forward" not in module.__dict__
        ):
            raise RematUsageError(
                f"remat_dist.apply_remat: block {name!r} ({type(module).__name__}) has "
                "no forward of its own (a container such as ModuleList is iterated, "
                "never called), so a checkpoint around it would never run. Fix: "
                "select the blocks inside it, e.g. blocks=Block."
            )
    wrappers = _nested_checkpoint_types()
    if wrappers:
        for name, module in selected:
            for sub_name, sub in module.named_modules():
                if isinstance(sub, wrappers):
                    where = f"{name}.{sub_name}" if sub_name else name
                    raise RematUsageError(
                        f"remat_dist.apply_remat: block {name!r} contains a torch "
                        f"CheckpointWrapper at {where!r}; nested checkpoints are not "
                        "supported. Fix: remove torch's checkpoint_wrapper and let "
                        "apply_remat checkpoint the block."
                    )
    fsdp_type = _fsdp_module_type()
    if fsdp_type is not None:
        units = [n for n, m in all_named if n and isinstance(m, fsdp_type)]
        check_no_fsdp_inside(
            selected_names,
            units,
            fix="pass the same blocks to apply_remat as to shard_model/fully_shard.",
        )

    budget = policy if isinstance(policy, MemoryBudget) else None
    if budget is not None:
        # profiled in the first step with full recompute, then planned (_budget)
        policy = "full"
        if budget.regions is None and adapter is not None:
            found = adapter.regions(model, selected)
            if found is not None:
                budget = dataclasses.replace(budget, regions=found)
    plans: list[tuple[str, nn.Module, dict[str, str]]] = []
    model.__dict__.setdefault(SELECTED_ATTR, []).extend(m for _, m in selected)
    if STEP_HOOK_ATTR not in model.__dict__:
        # A rank whose policy leaves blocks unchecked still takes part in the
        # agreements of its groups (so a rank-dependent policy raises there).
        model.__dict__[STEP_HOOK_ATTR] = model.register_forward_pre_hook(_mark_step)
    for index, (name, module) in enumerate(selected):
        regions = resolve_policy(policy, index, name, module)
        if regions is None:
            continue
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
        plans.append((name, module, regions))
    install = functools.partial(
        _install_plans,
        hooks=hooks,
        collectives=collectives,
        determinism_check=determinism_check,
    )
    undo = adapter.prepare(model, selected) if adapter is not None else None
    try:
        _forget_compiled(model, "apply_remat")
        if budget is not None:
            # before anything changes: a bad region list fails here
            attach = attach_budget(
                model, selected, budget, install=install, state_hooks=hooks,
                collectives=collectives,
                side_passes=None if adapter is None else functools.partial(
                    adapter.side_passes, model),
            )
            install(plans)
            attach()
        else:
            install(plans)
    except BaseException:
        if undo is not None:
            undo()
        raise
    if undo is not None:
        model.__dict__.setdefault(PREPARED_ATTR, []).append(undo)
    return model


def _install_plans(
    plans: list[tuple[str, nn.Module, dict[str, str]]],
    *,
    hooks: tuple[RecomputeStateHook, ...] | None,
    collectives: str,
    determinism_check: str,
) -> None:
    """Checkpoint each ``(name, block, regions)`` of ``plans`` (``apply_remat``'s
    last step; the memory-budget planner calls it again with its plan)."""
    # Build every checkpoint first: a bad option fails before anything changes.
    built = []
    for name, module, regions in plans:
        run = checkpoint(
            region_name=name,
            recompute_state_hooks=hooks,
            collectives=collectives,
            determinism_check=determinism_check,
        )(call_block)
        built.append((name, module, regions, run))
    for name, module, regions, run in built:
        spec = BlockRemat(
            name=name,
            regions=regions,
            state_hooks=hooks,
            collectives=collectives,
            previous_forward=instance_forward(module),
            run=run,
        )
        install_block(module, spec)
        for path, mode in regions.items():
            install_region(module.get_submodule(path), path, mode, block=name)


def _mark_step(module: nn.Module, args: Any) -> None:
    """A rank whose policy leaves a selected block unchecked takes part in the
    agreements of the groups its forward uses (its peers may checkpoint that block).
    Where every block is checkpointed, the checkpoints put their groups at stake
    themselves, and nothing else is looked at: FSDP2's collectives pass untouched."""
    if torch.is_grad_enabled() and any(
        BLOCK_ATTR not in b.__dict__ for b in module.__dict__.get(SELECTED_ATTR, ())
    ):
        mark_step()


def remove_remat(model: nn.Module) -> nn.Module:
    """Undo every :func:`apply_remat` on ``model`` (blocks and policy regions);
    returns ``model``. A no-op where nothing was applied.

    Raises :class:`RematUsageError` while a graph built through a checkpointed
    block is alive (its backward would replay the block without the regions its
    forward ran): run that backward, or drop its outputs, first."""
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
    detach_budget(model)
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
        if getattr(m, "_compiled_call_impl", None) is not None
    ]
    if compiled:
        log.info(
            "%s: %d compiled module(s) (%s) change plan: torch._dynamo.reset(), "
            "the next call recompiles",
            caller,
            len(compiled),
            ", ".join(compiled[:3]) + (", ..." if len(compiled) > 3 else ""),
        )
        torch._dynamo.reset()


def remat_plan(model: nn.Module) -> dict[str, BlockRemat]:
    """``{qualified name: BlockRemat}`` of the blocks :func:`apply_remat`
    checkpointed in ``model`` (empty when none)."""
    return {
        name: module.__dict__[BLOCK_ATTR]
        for name, module in model.named_modules()
        if BLOCK_ATTR in module.__dict__
    }


def checkpointed_names(model: nn.Module) -> list[str]:
    """Qualified names of the checkpointed blocks (for ``shard_model``'s checks)."""
    return list(remat_plan(model))
