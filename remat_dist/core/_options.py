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

DeterminismCheck = Literal["metadata", "metadata_per_tensor", "values"]
"""What a replay's saved tensors are checked for: their metadata (shape, dtype,
device) at the replay's end, their metadata as each is saved, or also their values
(fingerprints)."""

TorchDeterminismCheck = Literal["none", "default"]
"""torch's own names, accepted for code written against ``torch.utils.checkpoint``
or torch_remat (:data:`TORCH_DETERMINISM_ALIASES`)."""

DETERMINISM_CHECKS: tuple[DeterminismCheck, ...] = (
    "metadata", "metadata_per_tensor", "values"
)

TORCH_DETERMINISM_ALIASES: Mapping[str, DeterminismCheck] = {
    "none": "metadata",
    "default": "metadata_per_tensor",
}
"""torch's names mapped onto remat_dist's: ``"none"`` (torch's checks nothing;
remat_dist always checks metadata) is ``"metadata"``, ``"default"`` is
``"metadata_per_tensor"``, the check that names the model line as torch's does."""


def determinism_mode(value: Any, where: str) -> DeterminismCheck:
    """The ``determinism_check`` a checkpoint runs with: ``value`` itself, or the
    mode a torch name stands for; anything else raises naming ``where``."""
    if value in DETERMINISM_CHECKS:
        return value  # type: ignore[no-any-return]
    mode = TORCH_DETERMINISM_ALIASES.get(value) if isinstance(value, str) else None
    if mode is None:
        raise RematUsageError(
            f"{where}: determinism_check must be one of {DETERMINISM_CHECKS} (or "
            f"torch's names {tuple(TORCH_DETERMINISM_ALIASES)}), got {value!r}."
        )
    return mode


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

    determinism_check: DeterminismCheck = "metadata"
    """Always one of :data:`DETERMINISM_CHECKS` (torch's names are mapped)."""
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
