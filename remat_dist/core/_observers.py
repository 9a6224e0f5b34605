"""Attaching observers to every checkpoint (:func:`register_observer`) and running
a block without them (:func:`observers_suspended`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from remat_dist.core._record import _SEAMS, CheckpointObserver

__all__ = ["observers_suspended", "register_observer"]


class _ObserverHandle:
    def __init__(self, observer: Any) -> None:
        self._observer = observer

    def remove(self) -> None:
        if self._observer in _SEAMS.observers:
            _SEAMS.observers.remove(self._observer)
            _SEAMS.refresh()


def register_observer(observer: CheckpointObserver) -> _ObserverHandle:
    """Attach ``observer`` (a :class:`CheckpointObserver`) to every checkpoint in
    this process; returns a handle whose ``remove()`` detaches it."""
    _SEAMS.observers.append(observer)
    _SEAMS.refresh()
    return _ObserverHandle(observer)


@contextlib.contextmanager
def observers_suspended() -> Iterator[None]:
    """Run the block's checkpoint forwards without the registered observers: their
    records carry nothing of the layers above, so the observers leave their
    replays alone too (the distributed layer neither verifies nor agrees on
    them). A diagnostic: what the layers above cost, measured against the core
    alone (``python -m benchmarks.fsdp2_overhead --split``). Not for training."""
    observers = list(_SEAMS.observers)
    _SEAMS.observers.clear()
    _SEAMS.refresh()
    try:
        yield
    finally:
        _SEAMS.observers[:0] = observers
        _SEAMS.refresh()
