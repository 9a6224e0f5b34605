"""The step meter of a :class:`MemoryBudget` asked to measure its rank's peak
(``MemoryBudget(measure_peak=True)``): the most activation bytes alive at once
since the meter's window opened, over every forward of every model sharing the
budget on this rank, counted as ``remat_dist.testing.SavedBytesCounter`` counts
them (unique storages, parameters apart).

Why a meter of its own: the plan's prediction (``k x`` one forward's bytes,
summed over the models sharing the budget) is what the planner bounds; what a
schedule really keeps alive at once is what the cross-rank report shows. The
meter is entered around each forward of a model (outside the planner's own
counter, inside any saved-tensor hooks the caller entered first) and hands every
tensor on to those outer hooks, so offloading or another counter keeps working.
Each saved storage is followed until autograd frees its last saved reference.

After each forward the planner opens an after-forward window
(``remat_dist.budget._after``) into :meth:`StepMeter.after_sink`: what the loss
saves counts in the same live total, and ``after_at_peak`` is the part of the
peak saved after a forward (the loss's share).

It costs one Python pack call and one small object per saved tensor, in every
step it runs; the planner enters it only for a budget created with
``measure_peak=True`` (zero cost otherwise).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from remat_dist._torch._autograd import top_saved_tensors_hooks
from remat_dist.core import current_saved_tensor_info, plain, saved_tensors_hooks

__all__ = ["StepMeter"]


def _key(t: torch.Tensor) -> Any:
    local = plain(t)
    return (local.device, local.untyped_storage()._cdata)


class _Held:
    """What a saved tensor is packed into: the outer hooks' packed value (or the
    tensor), and the meter's reference to its storage until autograd frees it."""

    __slots__ = ("inner", "outer", "meter", "key")

    def __init__(self, inner: Any, outer: Any, meter: StepMeter, key: Any) -> None:
        self.inner, self.outer, self.meter, self.key = inner, outer, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class StepMeter:
    """Live and peak activation bytes of the forwards of some models on this rank.

    ``enter()`` / ``exit()`` bracket one forward of a model (nested pairs are
    fine: each ``enter`` opens its own hooks). ``total`` is what is alive now;
    ``peak`` the most alive at once since :meth:`restart` (or construction).
    """

    def __init__(self) -> None:
        self.params: set[Any] = set()
        self.live: dict[Any, list[int]] = {}
        self.total = 0
        self.peak = 0
        self.after = 0
        """Bytes alive now that a forward's after-window saved (the loss)."""
        self.after_at_peak = 0
        """``after`` when ``peak`` was reached."""
        self._open: list[saved_tensors_hooks] = []

    def add_parameters(self, model: nn.Module) -> None:
        """Set ``model``'s parameter storages apart (they are not activations)."""
        self.params.update(_key(p) for p in model.parameters())

    def restart(self) -> None:
        """Open a new window: the peak starts from what is alive now."""
        self.peak = self.total
        self.after_at_peak = self.after

    def after_sink(self) -> _AfterSink:
        """The sink of an after-forward window counting into this meter."""
        return _AfterSink(self)

    def _add(self, t: torch.Tensor, after: bool) -> Any:
        """Count ``t``'s storage (None: a parameter); the key to release."""
        key = _key(t)
        if key in self.params or isinstance(plain(t), nn.Parameter):
            return None
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [plain(t).untyped_storage().nbytes(), 0, after]
            self.total += entry[0]
            if after:
                self.after += entry[0]
            if self.total > self.peak:
                self.peak = self.total
                self.after_at_peak = self.after
        entry[1] += 1
        return key

    def enter(self) -> None:
        top = top_saved_tensors_hooks(False)
        outer: Any = None
        if top is not None:
            pack, unpack = top
            owner = getattr(pack, "__self__", None)
            outer = owner if isinstance(owner, saved_tensors_hooks) else (pack, unpack)
        hooks = saved_tensors_hooks(
            lambda t, outer=outer: self._pack(t, outer), self._unpack
        )
        hooks.__enter__()
        self._open.append(hooks)

    def exit(self) -> None:
        if self._open:
            self._open.pop().__exit__(None, None, None)

    def _pack(self, t: torch.Tensor, outer: Any) -> Any:
        if outer is None:
            inner: Any = t.detach()
        elif isinstance(outer, saved_tensors_hooks):
            inner = outer.pack_with(t, current_saved_tensor_info())
        else:
            inner = outer[0](t)
        return _Held(inner, outer, self, self._add(t, after=False))

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        outer = held.outer
        if outer is None:
            return held.inner
        if isinstance(outer, saved_tensors_hooks):
            return outer.unpack_with(held.inner)
        return outer[1](held.inner)

    def _release(self, key: Any) -> None:
        if key is None:
            return
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]
            self.total -= entry[0]
            if entry[2]:
                self.after -= entry[0]


class _AfterSink:
    """An after-forward window's view of a :class:`StepMeter`."""

    def __init__(self, meter: StepMeter) -> None:
        self.meter = meter

    def saved(self, t: torch.Tensor) -> Any:
        return self.meter._add(t, after=True)

    def release(self, key: Any) -> None:
        self.meter._release(key)
