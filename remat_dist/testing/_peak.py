"""``PeakSavedBytes``: the most activation bytes alive at once over a whole step,
every forward whose graph is alive counted (a pipeline schedule keeps several
micro-batches in flight), as :class:`SavedBytesCounter` counts them: unique
storages saved for backward, parameters apart."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from remat_dist.core import plain, saved_tensors_hooks

__all__ = ["PeakSavedBytes"]


class _Held:
    """What a saved tensor is packed into: keeps its storage counted until
    autograd frees it (after its node's backward, or with the graph)."""

    __slots__ = ("t", "meter", "key")

    def __init__(self, t: torch.Tensor, meter: PeakSavedBytes, key: Any) -> None:
        self.t, self.meter, self.key = t, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class PeakSavedBytes:
    """Live and peak saved bytes of the forwards' graphs of ``module`` (and of
    ``more`` modules: the stage modules of one rank under an interleaved
    pipeline schedule, counted together, the rank's peak).

    An outermost saved-tensor hook is entered around each forward of each module
    (before any hook the module's own forward pre-hooks push, which hand it every
    tensor) and follows each saved storage until autograd frees its last saved
    reference. ``total`` is what is alive now, ``peak`` the most since
    construction or :meth:`reset` (call it at a step's start for a per-step
    peak)."""

    def __init__(self, module: nn.Module, *more: nn.Module) -> None:
        modules = (module, *more)
        self.params = {self._key(p) for m in modules for p in m.parameters()}
        self.live: dict[Any, list[int]] = {}
        self.total = 0
        self.peak = 0
        self._hooks = saved_tensors_hooks(
            self._pack, lambda h: h.t if isinstance(h, _Held) else h
        )
        for m in modules:
            m.register_forward_pre_hook(self._enter, prepend=True)
            m.register_forward_hook(self._exit, always_call=True)

    def reset(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak = self.total

    @staticmethod
    def _key(t: torch.Tensor) -> Any:
        local = plain(t)
        return (local.device, local.untyped_storage()._cdata)

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._hooks.__enter__()

    def _exit(self, module: nn.Module, args: Any, out: Any) -> None:
        self._hooks.__exit__(None, None, None)

    def _pack(self, t: torch.Tensor) -> Any:
        key = self._key(t)
        local = plain(t)
        if key in self.params or isinstance(local, nn.Parameter):
            return t.detach()
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [local.untyped_storage().nbytes(), 0]
            self.total += entry[0]
            self.peak = max(self.peak, self.total)
        entry[1] += 1
        return _Held(t.detach(), self, key)

    def _release(self, key: Any) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]
            self.total -= entry[0]
