"""The default state hooks: :func:`default_state_hooks` and the provider that makes
them the default of every ``checkpoint``.

The core knows nothing of ranks; it asks a provider for the hooks of a checkpoint
called with ``recompute_state_hooks=None``. :func:`install_default_provider`
(called when ``remat_dist.distributed`` is imported) installs the one here: this
rank's RNG hooks while a process group is initialised, the CPU generator (plus an
initialised accelerator's) in a single process. The hooks themselves are in
``remat_dist.distributed._rng``; this module only picks and caches sets of them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from remat_dist._state import register_state
from remat_dist._torch._c10d import default_group
from remat_dist.core import RecomputeStateHook, set_default_state_hooks_provider
from remat_dist.distributed._rank_device import accelerator_type, rank_device
from remat_dist.distributed._rng import (
    CPURNGStateHook,
    DeviceRNGStateHook,
    DTensorRNGStateHook,
)

__all__ = ["default_state_hooks", "install_default_provider"]


def default_state_hooks(
    device: torch.device | str | int | None = None, *, cpu: bool = False
) -> tuple[RecomputeStateHook, ...]:
    """The hook set that makes a normal FSDP2 / TP model replay exactly on this rank.

    ``(DeviceRNGStateHook(device), DTensorRNGStateHook(...))`` on an accelerator run
    (the DTensor hook skips the device hook's generator, so it costs nothing more
    unless DTensor uses another device's generator), plus :class:`CPURNGStateHook`
    with ``cpu=True``. On a CPU-only run the device hook *is* the CPU generator and
    DTensor keeps nothing else, so the set is that one hook (5056 bytes a
    snapshot), ``cpu=True`` or not. Generators the model passes explicitly
    (``generator=``) need their own :class:`GeneratorStateHook`.

    Args:
        device: the rank's device (default: the one :func:`rank_device` picks:
            the current accelerator, ``LOCAL_RANK``'s, else the CPU).
        cpu: also keep the CPU generator on an accelerator run.

    Returns:
        The hooks, to pass as ``recompute_state_hooks=`` (``apply_remat`` and a
        checkpoint use this set by default under a process group).

    Example::

        hooks = remat_dist.distributed.default_state_hooks(cpu=True)
        remat_dist.checkpoint(region_name="layers.0", recompute_state_hooks=hooks)(blk)
    """
    dev_hook = DeviceRNGStateHook(device)
    hooks: list[RecomputeStateHook] = [dev_hook]
    if dev_hook.device.type != "cpu":
        if torch.distributed.is_available():
            hooks.append(DTensorRNGStateHook(exclude_devices=(dev_hook.device,)))
        if cpu:
            hooks.append(CPURNGStateHook())
    return tuple(hooks)


@dataclass
class DefaultHooksCache:
    """The default state hooks made so far: per device while a process group is up
    (``provider``), per accelerator in one process (``single``). The hooks hold no
    per-call state, so one set per key is reused."""

    provider: dict[torch.device, tuple[RecomputeStateHook, ...]] = field(
        default_factory=dict
    )
    single: dict[str, tuple[RecomputeStateHook, ...]] = field(default_factory=dict)
    gloo_world: Any = None
    """A weak reference to the default group last found to be gloo only (a CPU
    run), so that each checkpoint does not ask for the backend again. Weak: a
    process group still referenced when the interpreter finalizes, after
    ``destroy_process_group()``, makes gloo abort the process ("terminate called
    without an active exception")."""

    def reset(self) -> None:
        self.provider.clear()
        self.single.clear()
        self.gloo_world = None


_CPU = torch.device("cpu")
_CACHE = register_state("distributed.default_state_hooks", DefaultHooksCache())


def _distributed_provider() -> tuple[RecomputeStateHook, ...]:
    world = default_group()
    if world is None:
        return _single_process_hooks()
    import torch.distributed as dist

    # A group whose only backend is gloo is a CPU run, also on a machine with an
    # accelerator (the test harness, CPU launches). The hooks hold no per-call
    # state: reuse one set per device (resolved per call, so a set_device after
    # install is honoured).
    cached = _CACHE.gloo_world
    if cached is not None and cached() is world:
        device = _CPU
    elif dist.get_backend() == "gloo":
        device, _CACHE.gloo_world = _CPU, weakref.ref(world)
    else:
        device = rank_device()
    hooks = _CACHE.provider.get(device)
    if hooks is None:
        hooks = _CACHE.provider[device] = default_state_hooks(device)
    return hooks


def _single_process_hooks() -> tuple[RecomputeStateHook, ...]:
    """One process: the CPU generator, plus the current accelerator's generator once
    that accelerator is initialised (never initialising it), as
    ``torch.utils.checkpoint``'s ``preserve_rng_state`` covers both. Dropout then
    replays exactly by default, never silently differently."""
    acc = accelerator_type()
    initialized = False
    if acc is not None:
        module = torch.get_device_module(acc)
        is_init = getattr(module, "is_initialized", None)
        initialized = bool(is_init()) if callable(is_init) else False
    key = acc if initialized else "cpu"
    hooks = _CACHE.single.get(key)
    if hooks is None:
        hooks = (CPURNGStateHook(),)
        if initialized:
            hooks += (DeviceRNGStateHook(),)
        _CACHE.single[key] = hooks
    return hooks


def install_default_provider() -> None:
    """Make :func:`default_state_hooks` the state hooks of ``checkpoint`` by default.

    After this, a checkpoint called with ``recompute_state_hooks=None`` (the
    default) gets this rank's RNG hooks while a ``torch.distributed`` process group
    is initialised, and in a single process the CPU generator (plus the current
    accelerator's, once initialised), so dropout never replays silently
    differently. A
    default group whose only backend is gloo counts as a CPU run:
    ``default_state_hooks("cpu")``, the CPU generator, even where an accelerator is
    present (CUDA tensors over gloo need explicit hooks).
    """
    set_default_state_hooks_provider(_distributed_provider)
