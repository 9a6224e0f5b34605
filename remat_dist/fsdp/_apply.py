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

Policies
--------
``policy`` decides, per block, what the checkpoint keeps:

``"full"``
    recompute the whole block in backward (keep only its inputs).
``"none"``
    leave the block alone.
``{"attention": "save", ...}``
    checkpoint the block, but make each call of the named submodules (paths
    relative to the block) a region: ``"save"`` keeps that call's activations and
    skips it on replay (its outputs are persisted, since block code such as
    ``x + self.attention(h)`` reads them outside any region); ``"recompute"``
    reruns it (a named region in traces and reports). The region covers the whole
    module call, the submodule's own hooks included (tensor-parallel
    ``PrepareModuleInput`` on ``attention``, say), so a saved submodule's
    communication is not replayed either.
``{"every": k}`` or the int ``k``
    checkpoint only every k-th matched block, counting from the first one: blocks
    with index ``i % k == 0`` (so ``k=2`` checkpoints blocks 0, 2, 4, ...). A dict
    may combine ``"every"`` with submodule entries.
a callable ``(qualified_name, module) -> "full" | "none" | dict``
    decided per block (the dict must not contain ``"every"``).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import nn

from remat_dist.core import (
    RecomputeStateHook,
    checkpoint,
    recompute_needs_tensor,
    region,
)
from remat_dist.distributed import mark_step
from remat_dist.errors import RematUsageError
from remat_dist.fsdp._blocks import BlockSelector, select_blocks, strictly_inside

__all__ = [
    "BlockRemat",
    "RematPolicy",
    "apply_remat",
    "remat_plan",
    "remove_remat",
]

BLOCK_ATTR = "_remat_dist_block"
"""Instance attribute of a checkpointed block: its :class:`BlockRemat`."""

REGION_ATTR = "_remat_dist_region"
"""Instance attribute of a submodule turned into a region: its :class:`_RegionSpec`."""

STEP_HOOK_ATTR = "_remat_dist_step_hook"
"""On the model: the handle of the pre-hook that calls ``mark_step()``."""

REGION_MODES = ("save", "recompute")

RematPolicy = Union[
    str,
    int,
    Mapping[str, Any],
    Callable[[str, nn.Module], Union[str, Mapping[str, str]]],
]
"""What ``policy=`` accepts (see the module docstring)."""


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


@dataclass
class _RegionSpec:
    name: str
    mode: str
    block: str
    attr: str = "_call_impl"
    """The instance attribute replaced: ``_call_impl`` (the whole module call,
    hooks included) or ``forward`` (fallback: the module's hooks stay outside)."""
    previous: Any = field(default=None, repr=False)
    run: Any = field(default=None, repr=False)


def _call_block(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    prev = module.__dict__[BLOCK_ATTR].previous_forward
    if prev is None:
        return type(module).forward(module, *args, **kwargs)
    return prev(*args, **kwargs)


def _call_region(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    spec: _RegionSpec = module.__dict__[REGION_ATTR]
    if spec.previous is not None:
        return spec.previous(*args, **kwargs)
    return getattr(type(module), spec.attr)(module, *args, **kwargs)


_CALL_IMPL_OK: bool | None = None


def _call_impl_overridable() -> bool:
    """Whether ``nn.Module.__call__`` dispatches through an instance
    ``_call_impl`` in this torch (it does in 2.x: ``_wrapped_call_impl``)."""
    global _CALL_IMPL_OK
    if _CALL_IMPL_OK is None:

        class _Probe(nn.Module):
            def forward(self) -> int:
                return 0

        probe = _Probe()
        probe.__dict__["_call_impl"] = lambda *a, **k: 1
        try:
            _CALL_IMPL_OK = probe() == 1
        except Exception:  # pragma: no cover - torch internals changed
            _CALL_IMPL_OK = False
    return _CALL_IMPL_OK


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Instance ``forward`` of a block: the original forward in a checkpoint."""
    return self.__dict__[BLOCK_ATTR].run(self, *args, **kwargs)


def _region_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Instance ``_call_impl`` (or ``forward``) of a policy submodule: the module
    call as a region.

    Replacing ``_call_impl`` puts the submodule's own hooks inside the region, so
    a save region also skips, on replay, what tensor-parallel input/output hooks
    on that submodule communicate. A save region's outputs are persisted: block
    code reads them outside any region (``x + self.attention(h)``), and replay
    must feed that code real values.
    """
    spec: _RegionSpec = self.__dict__[REGION_ATTR]
    out = spec.run(self, *args, **kwargs)
    if spec.mode == "save":
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if tensors:
            recompute_needs_tensor(*tensors)
    return out


def _existing_instance_forward(module: nn.Module) -> Any:
    return module.__dict__.get("forward")


def _resolve_policy(
    policy: RematPolicy, index: int, name: str, module: nn.Module
) -> dict[str, str] | None:
    """The region map for one block, or None to leave it alone."""
    where = f"remat_dist.apply_remat(policy=...) for block {name!r}"
    if isinstance(policy, bool):
        raise RematUsageError(f"{where}: policy must not be a bool, got {policy!r}.")
    if isinstance(policy, int):
        policy = {"every": policy}
    if isinstance(policy, str):
        if policy == "full":
            return {}
        if policy == "none":
            return None
        raise RematUsageError(
            f"{where}: unknown policy {policy!r}. Fix: use 'full', 'none', a dict "
            "such as {'attention': 'save'}, {'every': 2}, or a callable "
            "(qualified_name, module) -> 'full' | 'none' | dict."
        )
    if isinstance(policy, Mapping):
        regions = dict(policy)
        every = regions.pop("every", 1)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise RematUsageError(
                f"{where}: 'every' must be a positive int, got {every!r}."
            )
        if index % every:
            return None
        return _check_regions(regions, name, module)
    if callable(policy):
        decided = policy(name, module)
        if isinstance(decided, Mapping) and "every" in decided:
            raise RematUsageError(
                f"{where}: the policy callable returned a dict with 'every'; a "
                "callable decides per block already. Fix: return 'none' for the "
                "blocks to skip."
            )
        if not isinstance(decided, (str, Mapping)):
            raise RematUsageError(
                f"{where}: the policy callable returned {decided!r}; expected 'full', "
                "'none' or a dict {submodule: 'save' | 'recompute'}."
            )
        return _resolve_policy(decided, 0, name, module)
    raise RematUsageError(
        f"{where}: policy must be a str, an int, a dict or a callable, got "
        f"{type(policy).__name__}."
    )


def _check_regions(
    regions: dict[str, Any], name: str, block: nn.Module
) -> dict[str, str]:
    for path, mode in regions.items():
        if not isinstance(path, str) or not path:
            raise RematUsageError(
                f"remat_dist.apply_remat: policy keys are submodule paths relative to "
                f"the block, got {path!r} for block {name!r}."
            )
        if mode not in REGION_MODES:
            raise RematUsageError(
                f"remat_dist.apply_remat: policy[{path!r}] for block {name!r} is "
                f"{mode!r}; expected one of {REGION_MODES}."
            )
        try:
            block.get_submodule(path)
        except AttributeError:
            children = [n for n, _ in block.named_modules() if n]
            shown = ", ".join(children[:12]) + (", ..." if len(children) > 12 else "")
            raise RematUsageError(
                f"remat_dist.apply_remat: block {name!r} ({type(block).__name__}) has "
                f"no submodule {path!r} named in the policy. Its submodules: {shown}. "
                "Fix: use a path relative to the block, or a callable policy for "
                "blocks of different shapes."
            ) from None
    for outer, mode in regions.items():
        for inner, inner_mode in regions.items():
            if mode == "save" and strictly_inside(outer, inner):
                raise RematUsageError(
                    f"remat_dist.apply_remat: in block {name!r}, {inner!r} "
                    f"({inner_mode}) lies inside save region {outer!r}, whose body "
                    "is never replayed. Fix: drop the inner entry."
                )
    return dict(regions)


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
    blocks: BlockSelector,
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
            or fully qualified names (see ``remat_dist.fsdp._blocks``).
        policy: what each checkpoint keeps (see the module docstring): ``"full"``,
            ``{"attention": "save"}``, ``{"every": k}`` / ``k``, or a callable.
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
    undoes it. Raises :class:`RematUsageError` when a block is already
    checkpointed (naming it), when selected blocks nest, when a block contains FSDP
    units or a ``CheckpointWrapper``, or when the policy names missing submodules.
    """
    if not isinstance(model, nn.Module):
        raise RematUsageError(
            f"remat_dist.apply_remat: model must be an nn.Module, got "
            f"{type(model).__name__}."
        )
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

    plans: list[tuple[str, nn.Module, dict[str, str]]] = []
    if STEP_HOOK_ATTR not in model.__dict__:
        # Every rank takes part in each step's plan agreement, also one whose
        # policy checkpoints nothing (so a rank-dependent policy raises everywhere).
        model.__dict__[STEP_HOOK_ATTR] = model.register_forward_pre_hook(_mark_step)
    for index, (name, module) in enumerate(selected):
        regions = _resolve_policy(policy, index, name, module)
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
    # Build every checkpoint first: a bad option fails before anything changes.
    built = []
    for name, module, regions in plans:
        run = checkpoint(
            region_name=name,
            recompute_state_hooks=hooks,
            collectives=collectives,
            determinism_check=determinism_check,
        )(_call_block)
        built.append((name, module, regions, run))
    for name, module, regions, run in built:
        spec = BlockRemat(
            name=name,
            regions=regions,
            state_hooks=hooks,
            collectives=collectives,
            previous_forward=_existing_instance_forward(module),
            run=run,
        )
        module.__dict__[BLOCK_ATTR] = spec
        module.forward = types.MethodType(_checkpointed_forward, module)
        for path, mode in regions.items():
            sub = module.get_submodule(path)
            attr = "forward"
            if _call_impl_overridable() and sub._compiled_call_impl is None:
                attr = "_call_impl"
            rspec = _RegionSpec(
                name=path,
                mode=mode,
                block=name,
                attr=attr,
                previous=sub.__dict__.get(attr),
                run=region(_call_region, path, recompute=(mode == "recompute")),
            )
            sub.__dict__[REGION_ATTR] = rspec
            sub.__dict__[attr] = types.MethodType(_region_call, sub)
    return model


def _mark_step(module: nn.Module, args: Any) -> None:
    if torch.is_grad_enabled():
        mark_step()


def _restore_forward(module: nn.Module, previous: Any) -> None:
    if previous is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = previous


def remove_remat(model: nn.Module) -> nn.Module:
    """Undo every :func:`apply_remat` on ``model`` (blocks and policy regions);
    returns ``model``. A no-op where nothing was applied."""
    hook = model.__dict__.pop(STEP_HOOK_ATTR, None)
    if hook is not None:
        hook.remove()
    for _, module in model.named_modules():
        spec = module.__dict__.pop(REGION_ATTR, None)
        if spec is not None:
            module.__dict__.pop(spec.attr, None)
            if spec.previous is not None:
                module.__dict__[spec.attr] = spec.previous
        bspec = module.__dict__.pop(BLOCK_ATTR, None)
        if bspec is not None:
            _restore_forward(module, bspec.previous_forward)
    return model


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
