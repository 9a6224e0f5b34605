"""Checkpoint and region options: core's own, and those the layers above declare.

The core knows two options of its own (``determinism_check`` and
``saved_tensors_hooks``, which change what it does). Everything else a layer above
needs to read per checkpoint or per region (the distributed layer's
``collectives=``) is *declared* by that layer with :func:`declare_option`: its
default and its validation live there, and the core only carries the value, frozen,
in :class:`CheckpointOptions` (``record.options``) or ``RegionRecord.options``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from remat_dist._errors import RematUsageError

__all__ = ["CheckpointOptions", "OptionSpec", "declare_option", "declared_options"]

DeterminismCheck = Literal["none", "default", "values"]


@dataclass(frozen=True)
class OptionSpec:
    """An option a layer above declared."""

    name: str
    default: Any
    """The checkpoint's default."""
    validate: Callable[[Any, str], Any]
    """``(value, where) -> value``: raises :class:`RematUsageError` naming ``where``
    and the fix, or returns the value to keep (normalised)."""
    doc: str
    region_default: Any = None
    """A region's default (None: the checkpoint's value applies)."""
    region: bool = False
    """Whether ``region(...)`` takes it too."""


_declared: dict[str, OptionSpec] = {}


class _OptionHandle:
    def __init__(self, spec: OptionSpec) -> None:
        self._spec = spec

    def remove(self) -> None:
        if _declared.get(self._spec.name) is self._spec:
            del _declared[self._spec.name]


def declare_option(spec: OptionSpec) -> _OptionHandle:
    """Let ``checkpoint(...)`` (and ``region(...)`` if ``spec.region``) take
    ``spec.name``; declaring the same name again replaces it. Returns a handle
    whose ``remove()`` withdraws it."""
    _declared[spec.name] = spec
    return _OptionHandle(spec)


def declared_options() -> Mapping[str, OptionSpec]:
    return dict(_declared)


@dataclass(frozen=True)
class CheckpointOptions:
    """What one checkpoint was asked for (``record.options``).

    ``extensions`` holds the declared options' values (every declared option,
    defaults filled in); :meth:`get` reads one.
    """

    determinism_check: DeterminismCheck = "none"
    saved_tensors_hooks: Any = None
    extensions: Mapping[str, Any] = field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        return self.extensions.get(name, default)


def resolve(
    given: Mapping[str, Any], where: str, *, region: bool, hint: str = ""
) -> dict[str, Any]:
    """The declared options' values for one checkpoint (or region): ``given``
    validated, defaults filled in. Unknown names raise, listing what is supported
    (``hint`` says why an unknown one is not needed)."""
    usable = {n: s for n, s in _declared.items() if s.region or not region}
    unknown = sorted(n for n in given if n not in usable)
    if unknown:
        own = "fn, name, recompute" if region else (
            "region_name, recompute_state_hooks, saved_tensors_hooks, "
            "determinism_check, preserve_rng_state"
        )
        raise RematUsageError(
            f"{where} got unsupported option(s) {', '.join(unknown)}.{hint} "
            f"Supported: {', '.join([own, *usable])}."
        )
    out = {name: usable[name].validate(value, where) for name, value in given.items()}
    for name, spec in usable.items():
        if name not in out:
            out[name] = spec.region_default if region else spec.default
    return out
