"""What a rank saves for backward after a model's forward returns: the loss.

A plain loop computes ``F.cross_entropy(model(x), y)`` outside the model; a
pipeline schedule calls its ``loss_fn`` on the last stage's output. Those saves
(the log-softmax of the logits, an MSE's inputs) live as long as the forward's
graph and belong to the rank's step as much as the model's own. The memory
budget sees them through an **after-forward window**: when a model under a
budget returns from its forward, the window starts counting what this thread
saves for backward, until the next forward of a model under a budget begins.

How, without leaving a saved-tensor hook that another context would pop: the
window does not push onto the saved-tensor hooks stack when the stack holds
hooks; it *replaces* the innermost pair by a wrapper that counts and hands every
tensor on to it. Whoever pops that entry (the context that pushed the pair it
replaced) pops the wrapper, and the stack is as it would have been. On an empty
stack it pushes the wrapper, which no open context can pop. Closing the window
puts the replaced pair back (or pops the wrapper) when the wrapper is still
innermost; otherwise the wrapper stays as a plain pass-through, removed once it
is innermost again at a later close. Saves made inside a backward (a
checkpoint's replay) are handed on uncounted: the budget bounds what the step's
forwards and their losses keep.

What the window cannot see: a loss computed on another thread than the model's
forward, or whose saved-tensor hooks are entered by a forward hook registered
after ``apply_remat`` and left after the forward (that context pops the
wrapper). Code that saves before the model's forward (an embedding outside the
model) is not counted either: put it in the model.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from remat_dist._torch._autograd import (
    current_graph_task_id,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    saved_tensors_hooks_enabled,
    top_saved_tensors_hooks,
)

__all__ = ["Sink", "close_window", "open_window"]


class Sink(Protocol):
    """Where an after-forward window reports: ``saved`` returns a key (None:
    not counted, a parameter) that ``release`` gets when autograd frees it."""

    def saved(self, t: torch.Tensor) -> Any: ...

    def release(self, key: Any) -> None: ...


class _Held:
    __slots__ = ("inner", "sink", "key")

    def __init__(self, inner: Any, sink: Sink | None, key: Any) -> None:
        self.inner, self.sink, self.key = inner, sink, key

    def __del__(self) -> None:
        if self.sink is not None and self.key is not None:
            self.sink.release(self.key)


class _Window:
    """The wrapper pair standing in for the innermost pair (``replaced``, None
    when the stack was empty)."""

    def __init__(self, sinks: list[Sink], replaced: tuple[Any, Any] | None) -> None:
        self.sinks = sinks
        self.replaced = replaced
        self.open = True

    def pack(self, t: torch.Tensor) -> Any:
        outer = self.replaced
        inner = outer[0](t) if outer is not None else (t.detach(), t._version)
        if not self.open or current_graph_task_id() != -1:
            return _Held(inner, None, None)
        held = [(sink, sink.saved(t)) for sink in self.sinks]
        if len(held) == 1:
            return _Held(inner, *held[0])
        return _Held(inner, _Many(held), True)

    def unpack(self, held: _Held) -> torch.Tensor:
        outer = self.replaced
        if outer is not None:
            return outer[1](held.inner)
        t, version = held.inner
        if t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been "
                f"modified by an inplace operation: [{t.type()} {list(t.shape)}] is at "
                f"version {t._version}; expected version {version} instead (seen by "
                "remat_dist.MemoryBudget's count of what the loss saves)."
            )
        return t

    def innermost(self) -> bool:
        top = top_saved_tensors_hooks(False)
        return top is not None and top[0] == self.pack

    def remove(self) -> None:
        pop_saved_tensors_hooks()
        if self.replaced is not None:
            push_saved_tensors_hooks(*self.replaced)


class _Many:
    """Several sinks for one saved tensor (a budget profiling and another
    metering on one thread)."""

    def __init__(self, held: list[tuple[Sink, Any]]) -> None:
        self.held = held

    def release(self, key: Any) -> None:
        for sink, k in self.held:
            if k is not None:
                sink.release(k)


class _Thread(threading.local):
    def __init__(self) -> None:
        self.window: _Window | None = None
        self.stale: list[_Window] = []


_THREAD = _Thread()


def open_window(sinks: list[Sink]) -> None:
    """Count what this thread saves for backward from now until the next
    :func:`close_window` into ``sinks`` (nothing when hooks are disabled here)."""
    close_window()
    if not sinks or not saved_tensors_hooks_enabled():
        return
    top = top_saved_tensors_hooks(False)
    window = _Window(sinks, top)
    if top is not None:
        pop_saved_tensors_hooks()
    push_saved_tensors_hooks(window.pack, window.unpack)
    _THREAD.window = window


def close_window() -> None:
    """Stop counting on this thread: put the replaced pair back where the
    wrapper is still innermost (see the module doc)."""
    window, _THREAD.window = _THREAD.window, None
    if window is not None:
        window.open = False
        _THREAD.stale.append(window)
    stale = _THREAD.stale
    while stale and stale[-1].innermost():
        stale.pop().remove()
    # a wrapper another context popped is gone from the stack: forget it
    _THREAD.stale = [w for w in stale if _on_stack(w)]


def _on_stack(window: _Window) -> bool:
    """Whether ``window`` may still be on this thread's stack: only the
    innermost pair can be read, so a wrapper under another pair is kept."""
    return not window.innermost() and top_saved_tensors_hooks(False) is not None
