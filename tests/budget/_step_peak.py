"""``StepPeak``: every byte a rank saves for backward over whole steps, the loss
included, for the budget tests.

Entered around whole steps (``with meter: schedule.step(...)``), an outermost
saved-tensor hook counts each tensor saved outside a backward (a forward, the
loss after it) until autograd frees its last saved reference: unique storages,
parameters apart, as ``SavedBytesCounter`` counts them. A checkpoint's replay
in backward is not counted (the budget bounds what forwards and losses keep).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from remat_dist._torch._autograd import current_graph_task_id
from remat_dist.core import plain


class _Held:
    __slots__ = ("t", "meter", "key")

    def __init__(self, t: torch.Tensor, meter: StepPeak, key: Any) -> None:
        self.t, self.meter, self.key = t, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class StepPeak:
    """``peak``: the most bytes alive at once since the last :meth:`reset`;
    ``forward_peak``: the same counting only what the modules' forwards saved
    (the loss left out)."""

    def __init__(self, *modules: nn.Module) -> None:
        self.params = {self._key(p) for m in modules for p in m.parameters()}
        self.live: dict[Any, list[int]] = {}
        self.total = self.peak = 0
        self.forward_total = self.forward_peak = 0
        self._inside = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        for m in modules:
            m.register_forward_pre_hook(self._enter, prepend=True)
            m.register_forward_hook(self._leave, always_call=True)

    def _enter(self, *args: Any) -> None:
        self._inside += 1

    def _leave(self, *args: Any) -> None:
        self._inside -= 1

    def reset(self) -> None:
        self.peak = self.total
        self.forward_peak = self.forward_total

    @staticmethod
    def _key(t: torch.Tensor) -> Any:
        local = plain(t)
        return (local.device, local.untyped_storage()._cdata)

    def _pack(self, t: torch.Tensor) -> Any:
        key = self._key(t)
        if (current_graph_task_id() != -1 or key in self.params
                or isinstance(plain(t), nn.Parameter)):
            return _Held(t.detach(), self, None)
        entry = self.live.get(key)
        if entry is None:
            inside = self._inside > 0
            entry = self.live[key] = [plain(t).untyped_storage().nbytes(), 0, inside]
            self.total += entry[0]
            self.peak = max(self.peak, self.total)
            if inside:
                self.forward_total += entry[0]
                self.forward_peak = max(self.forward_peak, self.forward_total)
        entry[1] += 1
        return _Held(t.detach(), self, key)

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.t

    def _release(self, key: Any) -> None:
        entry = self.live.get(key) if key is not None else None
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]
            self.total -= entry[0]
            if entry[2]:
                self.forward_total -= entry[0]

    def __enter__(self) -> StepPeak:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
