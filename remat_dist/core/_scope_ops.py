"""Per-operator facts and the ambient state a ``gradient_checkpoint_scope`` records.

Leaf helpers for :mod:`remat_dist.core._scope_record` and
:mod:`remat_dist.core._scope_replay`: which arguments an ATen operator writes,
whether it draws random numbers (and from which generator), and the autocast state
an operator ran under, read and restored cheaply.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from remat_dist._torch._tensor import any_autocast_enabled

__all__ = [
    "OpInfo",
    "op_info",
    "generator_for",
    "autocast_state",
    "full_autocast_state",
    "apply_autocast",
    "restore_full_autocast",
]


class OpInfo(NamedTuple):
    """What the scope needs to know about one ``OpOverload``.

    Attributes:
        random: the operator draws from a generator (``nondeterministic_seeded``).
        write_pos: positions of arguments the operator writes in place.
        write_kw: names of keyword-only arguments it writes (``out=`` and friends).
        may_alias: some return value may share storage with an argument (a view or
            an in-place result, or an operator known to alias without saying so).
    """

    random: bool
    write_pos: frozenset[int]
    write_kw: frozenset[str]
    may_alias: bool


_NO_INFO = OpInfo(False, frozenset(), frozenset(), True)
INFO: dict[Any, OpInfo] = {}
"""The cache :func:`op_info` fills (read it directly on hot paths)."""

# Operators whose schema does not mark their return as an alias but that return a
# tensor sharing storage with an argument.
_UNMARKED_ALIASES = frozenset({"_unsafe_view"})
# Operators that write arguments their schema does not mark as written: the batch
# norm kernels update running_mean / running_var (positions 3 and 4) in place.
_UNMARKED_WRITES = {
    "native_batch_norm": (3, 4),
    "cudnn_batch_norm": (3, 4),
    "miopen_batch_norm": (3, 4),
}


def op_info(func: Any) -> OpInfo:
    """Facts about ``func`` read once from its schema and tags, then cached."""
    info = INFO.get(func)
    if info is not None:
        return info
    schema = getattr(func, "_schema", None)
    if schema is None:
        info = _NO_INFO
    else:
        name = schema.name.split("::")[-1]
        pos: set[int] = set(_UNMARKED_WRITES.get(name, ()))
        kw: set[str] = set()
        for i, arg in enumerate(schema.arguments):
            alias = arg.alias_info
            if alias is not None and alias.is_write:
                if arg.kwarg_only:
                    kw.add(arg.name)
                else:
                    pos.add(i)
        may_alias = (
            any(ret.alias_info is not None for ret in schema.returns)
            or name in _UNMARKED_ALIASES
        )
        tags = getattr(func, "tags", ())
        info = OpInfo(
            torch.Tag.nondeterministic_seeded in tags,
            frozenset(pos),
            frozenset(kw),
            may_alias,
        )
    INFO[func] = info
    return info


def _first_tensor_device(args: tuple[Any, ...]) -> torch.device | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    return b.device
    return None


def generator_for(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.Generator | None:
    """The generator a random operator called with these arguments draws from.

    An explicit ``generator=`` wins; otherwise the default generator of the device
    named by ``device=`` or of the first tensor argument. None where the device has
    no generator torch exposes (``meta``), so nothing needs restoring.
    """
    gen = kwargs.get("generator")
    if gen is not None:
        return gen
    dev = kwargs.get("device")
    device = torch.device(dev) if dev is not None else _first_tensor_device(args)
    if device is None:
        device = torch.device("cpu")
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    gens = getattr(module, "default_generators", None)
    if not gens:
        return None
    index = device.index
    if index is None:
        index = module.current_device()
    return gens[index]


def _autocast_device_types() -> tuple[str, ...]:
    types = ["cpu", "cuda"]
    accel = getattr(torch, "accelerator", None)
    current = accel.current_accelerator() if accel is not None else None
    if current is not None and current.type not in types:
        types.append(current.type)
    return tuple(types)


_AC_DEVICES = _autocast_device_types()
_AC_INTERN: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def autocast_state() -> tuple[Any, ...] | None:
    """The autocast state an operator runs under: None when autocast is off
    everywhere (the common case, one C call), else ``((enabled, dtype), ...)`` per
    device type in a fixed order, interned so equal states are the same object."""
    if not any_autocast_enabled():
        return None
    state = tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AC_DEVICES
    )
    return _AC_INTERN.setdefault(state, state)


def full_autocast_state() -> tuple[Any, ...]:
    """Everything :func:`restore_full_autocast` puts back after a replay."""
    per_device = tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AC_DEVICES
    )
    return (per_device, torch.is_autocast_cache_enabled())


def apply_autocast(state: tuple[Any, ...] | None) -> None:
    """Set the autocast state recorded by :func:`autocast_state` (None: all off)."""
    if state is None:
        for d in _AC_DEVICES:
            torch.set_autocast_enabled(d, False)
        return
    for d, (enabled, dtype) in zip(_AC_DEVICES, state, strict=True):
        torch.set_autocast_dtype(d, dtype)
        torch.set_autocast_enabled(d, enabled)


def restore_full_autocast(saved: tuple[Any, ...]) -> None:
    per_device, cache = saved
    apply_autocast(per_device)
    torch.set_autocast_cache_enabled(cache)
