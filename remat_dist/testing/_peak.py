"""``PeakSavedBytes``: the most activation bytes alive at once, every forward
whose graph is alive counted (a pipeline schedule keeps several micro-batches in
flight), as :class:`SavedBytesCounter` counts them: unique storages saved for
backward, parameters apart. Per forward of the modules, or over whole steps
(``whole_step=True``: the loss and whatever else runs between the forwards)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from remat_dist._errors import RematUsageError
from remat_dist._torch._autograd import current_graph_task_id
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

    By default an outermost saved-tensor hook is entered around each forward of
    each module (before any hook the module's own forward pre-hooks push, which
    hand it every tensor) and follows each saved storage until autograd frees
    its last saved reference: what the loss saves after the forward is not
    counted.

    ``whole_step=True`` counts what a memory budget bounds (``MemoryBudget``
    counts the loss): enter the meter around whole steps, and every tensor saved
    for backward outside a backward while it is entered is counted (the
    modules' forwards, what runs between them, the loss); a checkpoint's replay
    in backward is not::

        meter = PeakSavedBytes(model, whole_step=True)
        for batch, target in data:
            meter.reset()
            with meter:
                F.cross_entropy(model(batch), target).backward()
            print(meter.peak, meter.forward_peak)

    ``total`` is what is alive now, ``peak`` the most since construction or
    :meth:`reset` (call it at a step's start for a per-step peak);
    ``forward_peak`` the same counting only what the modules' forwards saved
    (equal to ``peak`` without ``whole_step``).

    Raises :class:`RematUsageError` when entered (``with meter:``) without
    ``whole_step=True``.
    """

    def __init__(self, module: nn.Module, *more: nn.Module, whole_step: bool = False) -> None:
        modules = (module, *more)
        self.whole_step = whole_step
        self.params = {self._key(p) for m in modules for p in m.parameters()}
        self.live: dict[Any, list[Any]] = {}
        self.total = self.peak = 0
        self.forward_total = self.forward_peak = 0
        self._inside = 0
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        for m in modules:
            m.register_forward_pre_hook(self._enter, prepend=True)
            m.register_forward_hook(self._exit, always_call=True)

    def reset(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak = self.total
        self.forward_peak = self.forward_total

    def __enter__(self) -> PeakSavedBytes:
        if not self.whole_step:
            raise RematUsageError(
                "remat_dist.testing.PeakSavedBytes: entered around a step, but it "
                "counts each forward of its modules by itself. Fix: "
                "PeakSavedBytes(model, whole_step=True) to count whole steps (the "
                "loss included), or call the model without `with meter:`."
            )
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    @staticmethod
    def _key(t: torch.Tensor) -> Any:
        local = plain(t)
        return (local.device, local.untyped_storage()._cdata)

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._inside += 1
        if not self.whole_step:
            self._hooks.__enter__()

    def _exit(self, module: nn.Module, args: Any, out: Any) -> None:
        self._inside -= 1
        if not self.whole_step:
            self._hooks.__exit__(None, None, None)

    def _pack(self, t: torch.Tensor) -> Any:
        key = self._key(t)
        local = plain(t)
        if (key in self.params or isinstance(local, nn.Parameter)
                or (self.whole_step and current_graph_task_id() != -1)):
            return t.detach()
        entry = self.live.get(key)
        if entry is None:
            inside = self._inside > 0
            entry = self.live[key] = [local.untyped_storage().nbytes(), 0, inside]
            self.total += entry[0]
            self.peak = max(self.peak, self.total)
            if inside:
                self.forward_total += entry[0]
                self.forward_peak = max(self.forward_peak, self.forward_total)
        entry[1] += 1
        return _Held(t.detach(), self, key)

    @staticmethod
    def _unpack(held: Any) -> torch.Tensor:
        return held.t if isinstance(held, _Held) else held

    def _release(self, key: Any) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]
            self.total -= entry[0]
            if entry[2]:
                self.forward_total -= entry[0]
