"""What a rank saves for backward after a model's forward returns: the loss.

A plain loop computes ``F.cross_entropy(model(x), y)`` outside the model; a
pipeline schedule calls its ``loss_fn`` on the last stage's output. Those saves
(the log-softmax of the logits, an MSE's inputs) live as long as the forward's
graph and belong to the rank's step as much as the model's own. The memory
budget sees them through an **after-forward window**: when a model under a
budget returns from its forward, the window starts counting what this thread
saves for backward, until the next forward of a model under a budget begins.

How, without leaving a saved-tensor hook that another context would pop: on an
empty stack the window pushes a counting pair, which no open context can pop.
When the stack holds a pair ``U`` (a context of the caller's, entered before the
forward), the window takes ``U`` off, pushes a counting pair that hands every
tensor on to the pair below ``U`` (or keeps it), and above it a counting pair
that hands every tensor on to ``U``. While ``U``'s context lives the upper one
counts (a context around forward and loss); when it exits it pops the upper
one, and the lower one counts (a context around the forward alone, the loss
after it). Closing the window restores the stack: ``U`` back in place of both,
or the lower pair popped once ``U``'s context has gone; a window whose pairs
are not innermost (the caller pushed more) stops counting and is removed once
they are. Saves made inside a backward (a checkpoint's replay) are handed on
uncounted: the budget bounds what the step's forwards and their losses keep.

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

from remat_dist._state import register_state
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


class _Pair:
    """A counting pair on the stack, handing every tensor on to ``outer`` (a
    ``(pack, unpack)`` pair; None: it keeps the tensor itself)."""

    def __init__(self, window: _Window, outer: tuple[Any, Any] | None) -> None:
        self.window, self.outer = window, outer

    def pack(self, t: torch.Tensor) -> Any:
        outer = self.outer
        inner = outer[0](t) if outer is not None else (t.detach(), t._version)
        sinks = self.window.sinks
        if not sinks or current_graph_task_id() != -1:
            return _Held(inner, None, None)
        held = [(sink, sink.saved(t)) for sink in sinks]
        if len(held) == 1:
            return _Held(inner, *held[0])
        return _Held(inner, _Many(held), True)

    def unpack(self, held: _Held) -> torch.Tensor:
        outer = self.outer
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


class _Window:
    """The pairs one window put on the stack (see the module doc): ``lower``
    always, ``upper`` in place of the caller's pair ``user`` when there was one."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks
        self.user = top_saved_tensors_hooks(False)
        if self.user is not None:
            pop_saved_tensors_hooks()
        self.lower = _Pair(self, top_saved_tensors_hooks(False))
        push_saved_tensors_hooks(self.lower.pack, self.lower.unpack)
        self.upper = None
        if self.user is not None:
            self.upper = _Pair(self, self.user)
            push_saved_tensors_hooks(self.upper.pack, self.upper.unpack)

    def try_remove(self) -> bool:
        """Take the window's pairs off where they are innermost; True when
        nothing of it is left on the stack."""
        if self.upper is not None and self.upper.innermost():
            pop_saved_tensors_hooks()
            self.upper = None
            if self.lower.innermost():
                pop_saved_tensors_hooks()
                assert self.user is not None
                push_saved_tensors_hooks(*self.user)
                return True
            return False  # pragma: no cover - nothing goes between the two
        if self.upper is None or not self.upper.innermost():
            if self.lower.innermost():
                pop_saved_tensors_hooks()
                return True
        return False


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
    _THREAD.window = _Window(sinks)


def close_window() -> None:
    """Stop counting on this thread and restore the stack (see the module
    doc); a window whose pairs are not innermost is removed at a later call."""
    window, _THREAD.window = _THREAD.window, None
    if window is not None:
        window.sinks = []  # counts nothing more; keeps nothing alive
        _THREAD.stale.append(window)
    stale = _THREAD.stale
    removed = True
    while removed:
        removed = False
        for w in list(stale):
            if w.try_remove():
                stale.remove(w)
                removed = True
    del stale[:-8]  # pairs buried under the caller's stay pass-throughs


class _Windows:
    """This thread's window, as ``reset_process_state`` puts it back: closed (a
    test, or a job that runs models in turn, starts with no counting pair on the
    stack)."""

    def reset(self) -> None:
        close_window()


register_state("budget.after_forward_window", _Windows())
