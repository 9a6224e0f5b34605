"""The instance patches behind ``apply_remat``: checkpointed blocks and policy regions.

``apply_remat`` (``remat_dist.wrap._apply``) decides what to checkpoint; this module
installs and removes the per-instance replacements that do it, and runs them:

* a block gets an instance ``forward`` that runs its previous forward (the
  instance's own, else the class's) inside its checkpoint, so module hooks (FSDP2's,
  block-level tensor-parallel ones) stay outside the checkpoint;
* a policy submodule gets an instance ``_call_impl`` (``nn.Module.__call__``
  dispatches through it), so the region covers the whole module call, hooks
  included; where that is not possible (a submodule compiled with
  ``module.compile()``, or a torch that does not dispatch through it) its
  ``forward`` is replaced instead.

Each patched module keeps what it replaced in an instance attribute
(:data:`BLOCK_ATTR`, :data:`REGION_ATTR`), which :func:`uninstall` puts back.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat_dist._torch._module import CALL_IMPL, call_impl_overridable, is_compiled
from remat_dist.core import (
    RecomputeStateHook,
    WeakRecords,
    current_frame,
    recompute_needs_tensor,
    region,
)

__all__ = [
    "BLOCK_ATTR",
    "REGION_ATTR",
    "BlockRemat",
    "RegionSpec",
    "blocks_with_live_graphs",
    "call_block",
    "install_block",
    "install_region",
    "instance_forward",
    "patch_state",
    "restore_patch_state",
    "uninstall",
]

BLOCK_ATTR = "_remat_dist_block"
"""Instance attribute of a checkpointed block: its ``BlockRemat``."""

REGION_ATTR = "_remat_dist_region"
"""Instance attribute of a submodule turned into a region: its :class:`RegionSpec`."""


@dataclass
class BlockRemat:
    """What :func:`apply_remat` did to one block (see :func:`checkpointed_blocks`).

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
    pending: WeakRecords = field(default_factory=WeakRecords, repr=False, compare=False)
    """The block's checkpoint records whose autograd graph is still alive: a
    backward through them would replay the block as its forward ran it."""
    replays: int = field(default=0, repr=False, compare=False)
    """How many replays of this block's checkpoint have run (a backward went
    through it, whatever tensor it started from)."""


@dataclass
class RegionSpec:
    """What :func:`install_region` did to one submodule (see ``checkpointed_blocks``'s
    ``BlockRemat.regions`` for the user-facing view)."""

    name: str
    mode: str
    block: str
    attr: str = CALL_IMPL
    """The instance attribute replaced: ``_call_impl`` (the whole module call,
    hooks included) or ``forward`` (fallback: the module's hooks stay outside)."""
    previous: Any = field(default=None, repr=False)
    run: Any = field(default=None, repr=False)


def call_block(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The block's forward as it was before ``apply_remat`` (what a checkpoint runs).

    A replay may come after ``remove_remat`` (a graph built, remat removed, then
    backpropagated): :func:`uninstall` has put that forward back on the module."""
    spec = module.__dict__.get(BLOCK_ATTR)
    if spec is None:
        return module.forward(*args, **kwargs)
    frame = current_frame()
    if frame is not None and frame.name == spec.name:
        if frame.replaying:
            spec.replays += 1
        else:
            spec.pending.add(frame)
            frame.extensions[_REGIONS_KEY] = spec.regions
            # reports name the inputs after the block's forward, not this runner
            if spec.previous_forward is None:
                frame.name_inputs_by(type(module).forward)
            else:
                frame.name_inputs_by(spec.previous_forward, first=1)
    if spec.previous_forward is None:
        return type(module).forward(module, *args, **kwargs)
    return spec.previous_forward(*args, **kwargs)


_REGIONS_KEY = "remat_dist.wrap.regions"
"""``record.extensions`` key of a block's checkpoint record: the regions its
forward ran (its replay runs the same, whatever plan is installed by then)."""


def blocks_with_live_graphs(modules: Any) -> list[str]:
    """Names of the checkpointed blocks among ``modules`` that a backward could
    still replay: a graph through their checkpoint is alive (not yet
    backpropagated, or kept with ``retain_graph``). Their patches must stay as they
    are until it is gone, since a replay runs the block as its forward ran it."""
    return [
        spec.name
        for m in modules
        if (spec := m.__dict__.get(BLOCK_ATTR)) is not None and len(spec.pending)
    ]


def _call_region(spec: RegionSpec, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What a region runs; ``spec`` is bound at install, so a replay after
    ``remove_remat`` still runs the call its forward ran."""
    if spec.previous is not None:
        return spec.previous(*args, **kwargs)
    return getattr(type(module), spec.attr)(module, *args, **kwargs)


_call_impl_overridable = call_impl_overridable


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Instance ``forward`` of a block: the original forward in a checkpoint."""
    spec = self.__dict__[BLOCK_ATTR]
    if torch.compiler.is_compiling():
        _guard_on_regions(spec.regions)
    return spec.run(self, *args, **kwargs)


def _guard_on_regions(regions: dict[str, str]) -> None:
    """Read each region's mode while Dynamo traces, so that the compiled block is
    guarded on them. Dynamo does not guard on a submodule's instance
    ``_call_impl``, which is how a region is installed: a block compiled without
    regions would otherwise be reused, silently, for a block of the same code
    with save regions (another model, or another plan, in the same process)."""
    for mode in regions.values():
        if mode == "save":
            continue


def _region_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Instance ``_call_impl`` (or ``forward``) of a policy submodule: the module
    call as a region.

    Replacing ``_call_impl`` puts the submodule's own hooks inside the region, so
    a save region also skips, on replay, what tensor-parallel input/output hooks
    on that submodule communicate. A save region's outputs are persisted: block
    code reads them outside any region (``x + self.attention(h)``), and replay
    must feed that code real values.
    """
    spec: RegionSpec = getattr(self, REGION_ATTR)
    mode, run = spec.mode, spec.run
    frame = current_frame()
    if frame is not None and frame.replaying:
        # a graph built under an earlier plan (the memory-budget planner installs
        # its plan while micro-batches of the profiling step wait for backward):
        # replay the call as that forward ran it
        bound = frame.extensions.get(_REGIONS_KEY)
        if bound is not None and bound.get(spec.name) != mode:
            mode = bound.get(spec.name)
            if mode is None:
                return _call_region(spec, self, *args, **kwargs)
            run = region(
                functools.partial(_call_region, spec), spec.name,
                recompute=(mode == "recompute"),
            )
    out = run(self, *args, **kwargs)
    if mode == "save":
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if tensors:
            recompute_needs_tensor(*tensors)
    return out


def instance_forward(module: nn.Module) -> Any:
    """The ``forward`` set on the instance itself (None: the class's is used)."""
    return module.__dict__.get("forward")


def install_block(module: nn.Module, spec: Any) -> None:
    """Make ``module`` run ``spec.run`` (its checkpoint) as its forward; ``spec``
    is the block's ``BlockRemat``."""
    module.__dict__[BLOCK_ATTR] = spec
    module.forward = types.MethodType(_checkpointed_forward, module)


def install_region(sub: nn.Module, path: str, mode: str, *, block: str) -> None:
    """Make every call of ``sub`` (at ``path`` in block ``block``) a region run
    in ``mode`` (``"save"`` or ``"recompute"``)."""
    attr = "forward"
    if _call_impl_overridable() and not is_compiled(sub):
        attr = CALL_IMPL
    rspec = RegionSpec(
        name=path, mode=mode, block=block, attr=attr, previous=sub.__dict__.get(attr)
    )
    rspec.run = region(
        functools.partial(_call_region, rspec), path, recompute=(mode == "recompute")
    )
    sub.__dict__[REGION_ATTR] = rspec
    sub.__dict__[attr] = types.MethodType(_region_call, sub)


def _restore_forward(module: nn.Module, previous: Any) -> None:
    if previous is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = previous


_PATCHED = (BLOCK_ATTR, REGION_ATTR, CALL_IMPL, "forward")
"""The instance attributes the install functions may set."""


def patch_state(module: nn.Module) -> dict[str, Any]:
    """What the install functions may change on ``module``, to put back exactly
    with :func:`restore_patch_state` (patches stacked on one module included)."""
    return {k: module.__dict__[k] for k in _PATCHED if k in module.__dict__}


def restore_patch_state(module: nn.Module, state: dict[str, Any]) -> None:
    for k in _PATCHED:
        if k in state:
            module.__dict__[k] = state[k]
        else:
            module.__dict__.pop(k, None)


def uninstall(module: nn.Module) -> None:
    """Undo :func:`install_block` and :func:`install_region` on ``module`` (either,
    both or none may have been applied)."""
    spec = module.__dict__.pop(REGION_ATTR, None)
    if spec is not None:
        module.__dict__.pop(spec.attr, None)
        if spec.previous is not None:
            module.__dict__[spec.attr] = spec.previous
    bspec = module.__dict__.pop(BLOCK_ATTR, None)
    if bspec is not None:
        _restore_forward(module, bspec.previous_forward)
