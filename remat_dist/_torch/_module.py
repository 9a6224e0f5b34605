"""``nn.Module``'s private call path and attributes: the instance ``_call_impl``
that ``nn.Module.__call__`` runs through (remat_dist's policy regions replace it),
the compiled call of ``module.compile()``, buffers, and dropout's base class."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = [
    "CALL_IMPL",
    "DropoutBase",
    "buffers_of",
    "call_impl_overridable",
    "is_compiled",
]

CALL_IMPL = "_call_impl"
"""The attribute ``nn.Module.__call__`` calls (``_wrapped_call_impl`` reads it from
the instance first): set on an instance, it wraps the whole call, hooks included."""

DropoutBase: type = nn.modules.dropout._DropoutNd
"""The base class of every dropout module."""


class _Probe:
    ok: bool | None = None


def call_impl_overridable() -> bool:
    """Whether ``nn.Module.__call__`` dispatches through an instance
    ``_call_impl`` in this torch (it does in 2.x: ``_wrapped_call_impl``);
    probed once."""
    if _Probe.ok is None:

        class _Module(nn.Module):
            def forward(self) -> int:
                return 0

        probe = _Module()
        probe.__dict__[CALL_IMPL] = lambda *a, **k: 1
        try:
            _Probe.ok = probe() == 1
        except Exception:  # pragma: no cover - torch internals changed
            _Probe.ok = False
    return _Probe.ok


def is_compiled(module: Any) -> bool:
    """Whether ``module.compile()`` compiled ``module`` (its call runs the
    compiled code)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def buffers_of(module: nn.Module) -> dict[str, Any]:
    """The dict ``module`` keeps its own buffers in (assigning into it replaces a
    buffer without the checks of ``register_buffer``)."""
    return module._buffers
