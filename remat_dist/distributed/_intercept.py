"""Interception of every ``c10d::`` collective on the calling thread (see
``_collectives`` for why a ``Fake``-key kernel and what it catches), the observer
stack of ``observe_collectives``, and the step hooks: process-wide callbacks run
before every collective issued inside a backward pass (where the plan agreement of
the ranks at stake runs) and, while a forward is noted, before every collective of
that forward issued outside a checkpoint (whose group the rank then takes part in
agreeing on)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from remat_dist._state import register_state
from remat_dist._torch import _autograd, _fsdp
from remat_dist._torch import _dispatch as _dk
from remat_dist.distributed._optable import (
    _NOT_COLLECTIVES,
    _flatten,
    _group_info,
    _GroupInfo,
    _OpSpec,
    _param_value,
    _spec_for,
    describe_signature,
    metas_of,
)
from remat_dist.distributed._ready import dist_ready

__all__ = [
    "CollectiveCall",
    "CollectiveObserver",
    "interception_key",
    "issued_by_fsdp",
    "ObserverExtent",
    "observe_collectives",
    "push_observer",
    "set_step_hooks",
    "step_hooks_set",
]


class CollectiveCall:
    """One collective about to be issued, as an observer sees it.

    ``op`` is the ``c10d::`` op name (``allreduce_``, ``_allgather_base_``, ...);
    ``group``, ``inputs``, ``outputs`` and ``params`` are computed on first use.
    """

    __slots__ = ("_spec", "args", "_keyset", "_group", "_sig")

    def __init__(self, spec: _OpSpec, args: tuple[Any, ...], keyset: Any) -> None:
        self._spec = spec
        self.args = args
        self._keyset = keyset
        self._group: _GroupInfo | None = None
        self._sig: tuple[Any, ...] | None = None

    @property
    def op(self) -> str:
        return self._spec.name

    @property
    def group(self) -> _GroupInfo:
        if self._group is None:
            self._group = _group_info(self.args[self._spec.group_idx])
        return self._group

    def _arg(self, i: int) -> Any:
        args = self.args
        return args[i] if i < len(args) else self._spec.defaults[i]

    def output_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for i in self._spec.out_idx:
            _flatten(self._arg(i), out)
        return out

    def input_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for i in self._spec.in_idx:
            _flatten(self._arg(i), out)
        return out

    @property
    def signature(self) -> tuple[Any, ...]:
        """What verification compares: op, group, metas, parameters."""
        sig = self._sig
        if sig is None:
            spec, args = self._spec, self.args
            defaults = spec.defaults
            ins = metas_of(spec.in_idx, args, defaults)
            outs = ins if spec.same_io else metas_of(spec.out_idx, args, defaults)
            params = tuple((n, _param_value(n, self._arg(i))) for n, i in spec.params)
            g = self.group
            sig = self._sig = (spec.name, g.name, g.ranks, ins, outs, params)
        return sig

    def set_timeout(self, seconds: float) -> bool:
        """Issue this call with a timeout of ``seconds`` (False: the op has none)."""
        if self._spec.timeout_idx is None:
            return False
        self.args = _with_timeout(self._spec, self.args, seconds)
        return True

    def _servable(self) -> bool:
        return self._spec.servable and all(
            t.layout == torch.strided for t in self.input_tensors()
        )

    def describe(self) -> str:
        op, gname, granks, ins, outs, params = self.signature
        return describe_signature(op, gname, granks, ins, outs, params)

    def _issue(self) -> Any:
        return _issue_bare(
            _dk.redispatch_of(self._spec.overload),
            self._keyset & _INSTALLED.after,
            self.args,
        )


# --------------------------------------------------------------- installation


@dataclass
class _Installation:
    """The kernels at the interception key: made once per process, on first use,
    and kept for its life (torch's dispatcher holds them; nothing resets this)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False
    key: Any = None
    """The dispatch key (``Fake`` where nothing else uses it)."""
    key_name: str = ""
    tls_toggled: bool = True
    """False: the key is always reached (``BackendSelect``); the stack decides."""
    after: Any = None
    """The keyset of the keys below ours (what a kernel redispatches to)."""
    libs: list[Any] = field(default_factory=list)
    specs: dict[str, _OpSpec] = field(default_factory=dict)


_INSTALLED = _Installation()


def _choose_key() -> tuple[str, bool]:
    if _dk.key_is_free("Fake") and _dk.key_reached_in_torch_dispatch("Fake"):
        return "Fake", True
    return "BackendSelect", False


def _install() -> None:
    inst = _INSTALLED
    with inst.lock:
        if inst.done:
            return
        import torch.distributed  # noqa: F401  (registers the c10d ops)
        from torch.library import Library, fallthrough_kernel

        name, toggled = _choose_key()
        key = _dk.parse_dispatch_key(name)
        libs = []
        if toggled:
            fb = Library("_", "IMPL")
            fb.fallback(fallthrough_kernel, name)
            libs.append(fb)
            _dk.hops_fall_through(key)
        lib = Library("c10d", "IMPL")
        specs: dict[str, _OpSpec] = {}
        for qual in _dk.all_op_names():
            if not qual.startswith("c10d::"):
                continue
            op_name = qual.split("::", 1)[1]
            if op_name in _NOT_COLLECTIVES:
                continue
            packet = getattr(torch.ops.c10d, op_name)
            overload = packet.default
            spec = _spec_for(op_name, overload)
            if spec is None:
                continue
            specs[op_name] = spec
            lib.impl(op_name, _make_kernel(spec), name, with_keyset=True)
        libs.append(lib)
        inst.key, inst.key_name, inst.tls_toggled = key, name, toggled
        inst.after = _dk.keyset_full_after(key)
        _fsdp.track_fsdp_collectives()
        inst.specs.update(specs)
        inst.libs.extend(libs)
        inst.done = True


def interception_key() -> str:
    """The dispatch key the collective kernels are registered at ("" before use)."""
    return _INSTALLED.key_name


# ------------------------------------------------------------- per-thread state


class _TLS(threading.local):
    def __init__(self) -> None:
        self.stack: list[CollectiveObserver] = []
        self.bypass = 0


_tls = _TLS()
_graph_task_id = _autograd.current_graph_task_id


@dataclass
class StepHooks:
    """The process-wide step hooks (:func:`set_step_hooks`)."""

    backward: Callable[[], None] | None = None
    forward_note: Callable[[tuple[int, ...]], None] | None = None

    def reset(self) -> None:
        set_step_hooks(None, None)


_HOOKS = register_state("distributed.step_hooks", StepHooks())


def _with_timeout(
    spec: _OpSpec, args: tuple[Any, ...], seconds: float
) -> tuple[Any, ...]:
    i = spec.timeout_idx
    assert i is not None
    out = list(args)
    while len(out) <= i:
        out.append(spec.defaults[len(out)])
    out[i] = max(1, int(seconds * 1000))
    return tuple(out)


def set_step_hooks(
    backward: Callable[[], None] | None,
    forward_note: Callable[[tuple[int, ...]], None] | None = None,
) -> None:
    """Run ``backward()`` before every collective issued inside a backward pass (on
    any thread); the collective itself is issued as it came.
    Run ``forward_note(ranks)`` before every collective issued outside a backward
    and outside any ``observe_collectives`` extent, with the ranks of its group,
    unless it is point-to-point or FSDP2's own. Both stay until reset with None.

    Also make this thread's collectives reach the kernels while a hook is set (the
    key stays included: the autograd engine hands the thread-local state of the
    ``backward()`` call to the threads that run it); resetting both takes the key
    out again. Hooks must be cheap when they have nothing to do: they are
    process-wide because the engine may run backward on its device threads.
    """
    hooks, inst = _HOOKS, _INSTALLED
    hooks.backward = backward
    hooks.forward_note = forward_note
    if backward is not None or forward_note is not None:
        if not inst.done:
            _install()
        if inst.tls_toggled and not _dk.tls_key_included(inst.key):
            _dk.tls_set_key_included(inst.key, True)
    # outside backward only: the engine puts back the state it was called in
    elif _graph_task_id() == -1 and step_hooks_set():
        _dk.tls_set_key_included(inst.key, False)


def step_hooks_set() -> bool:
    """Whether a step hook is set, or a reset inside backward left the key in."""
    inst, hooks = _INSTALLED, _HOOKS
    if hooks.backward is not None or hooks.forward_note is not None:
        return True
    return inst.done and inst.tls_toggled and not _tls.stack and (
        _dk.tls_key_included(inst.key)
    )


# ------------------------------------------------------------- FSDP2's own


def issued_by_fsdp() -> bool:
    """Whether the collective being issued is FSDP2's own: FSDP2's ``unshard`` or
    ``post_backward`` (which issue all of them) runs on this thread, as the wrap
    installed with the kernels counts (``_torch/_fsdp.py``)."""
    return _fsdp.inside_fsdp()


def _note(
    note: Callable[[tuple[int, ...]], None], spec: _OpSpec, args: tuple[Any, ...]
) -> None:
    if spec.agree is None or issued_by_fsdp():
        return
    note(_group_info(args[spec.group_idx]).ranks)


@contextlib.contextmanager
def _bypass() -> Iterator[None]:
    _tls.bypass += 1
    try:
        yield
    finally:
        _tls.bypass -= 1


def _make_kernel(spec: _OpSpec) -> Callable[..., Any]:
    redispatch = _dk.redispatch_of(spec.overload)
    hooks, inst = _HOOKS, _INSTALLED

    def kernel(keyset: Any, *args: Any) -> Any:
        tls = _tls
        below = keyset & inst.after
        if tls.bypass:
            return _issue_bare(redispatch, below, args)
        backward, forward_note = hooks.backward, hooks.forward_note
        if backward is not None or forward_note is not None:
            if _graph_task_id() != -1:
                if backward is not None:
                    backward()
            elif forward_note is not None and not tls.stack:
                _note(forward_note, spec, args)
        stack = tls.stack
        if not stack:
            return _issue_bare(redispatch, below, args)
        call = CollectiveCall(spec, args, keyset)
        return _dispatch(stack, len(stack) - 1, call)

    kernel.__name__ = f"remat_dist_observe_{spec.name}"
    return kernel


# ------------------------------------------------- issuing without Python TLS

_top_hooks = _autograd.top_saved_tensors_hooks
_pop_hooks = _autograd.pop_saved_tensors_hooks
_push_hooks = _autograd.push_saved_tensors_hooks


def _issue_bare(
    redispatch: Callable[..., Any], keyset: Any, args: tuple[Any, ...]
) -> Any:
    """Issue a ``c10d::`` op with this thread's saved-tensor hooks stack emptied.

    A backend captures the caller's whole ``at::ThreadLocalState`` in each work it
    enqueues (gloo's ``AsyncWork``) and installs it on its worker thread to run
    the work. Inside a checkpoint that state holds the checkpoint's pack/unpack
    hooks (torch's ``_checkpoint_hook`` in forward, ``_recomputation_hook`` in
    replay): Python objects, so the worker thread takes the GIL to copy, restore
    and free them after every such collective. A worker thread that waits for the
    GIL while the interpreter starts finalizing is ended by Python with
    ``pthread_exit``; the forced unwind meets a ``noexcept`` destructor
    (``~SafePyObject`` in ``SavedTensorDefaultHooks::set_tls_state``) and the
    process aborts: "terminate called without an active exception" (or "FATAL:
    exception not rethrown"). The hooks mean nothing below autograd, where this
    kernel sits (a collective saves nothing for backward), so they are taken off
    for the call and put back after it: the work then holds no Python object and
    its thread never needs the GIL.
    """
    top = _top_hooks(True)
    if top is None:
        return redispatch(keyset, *args)
    stashed = []
    while top is not None:
        stashed.append(top)
        _pop_hooks()
        top = _top_hooks(True)
    try:
        return redispatch(keyset, *args)
    finally:
        disabled = _autograd.saved_tensors_hooks_disabled_message()
        if disabled is not None:
            _autograd.saved_tensors_hooks_enable()
        try:
            for pack, unpack in reversed(stashed):
                _push_hooks(pack, unpack)
        finally:
            if disabled is not None:
                _autograd.saved_tensors_hooks_disable(disabled)


def _dispatch(stack: list[CollectiveObserver], level: int, call: CollectiveCall) -> Any:
    if level < 0:
        return call._issue()
    observer = stack[level]
    return observer.on_collective(call, lambda: _dispatch(stack, level - 1, call))


class CollectiveObserver(Protocol):
    """What ``observe_collectives`` accepts.

    ``on_collective(call, issue)`` runs for every collective of the extent, on the
    thread that issues it, before anything is sent; it returns the op's result,
    normally ``issue()`` (which issues it, through any outer observer). An optional
    ``on_extent_error(exc)`` runs when an exception leaves the extent.
    """

    def on_collective(self, call: CollectiveCall, issue: Callable[[], Any]) -> Any: ...


class ObserverExtent:
    """One observer pushed on this thread's stack (:func:`push_observer`), popped by
    :meth:`pop` in the callback that ends its extent: how a checkpoint's forward
    or replay, which starts in one observer callback and ends in another, routes
    its collectives. :func:`observe_collectives` is the ``with`` form. With
    ``observer=None`` only this thread's collectives reach the kernels, which issue
    them without the saved-tensor hooks (:func:`_issue_bare`): for an extent where
    remat_dist has Python hooks on the stack outside any checkpoint."""

    __slots__ = ("observer", "_stack", "_added")

    def __init__(
        self, observer: CollectiveObserver | None, checked: bool = False
    ) -> None:
        self.observer, self._stack, self._added = observer, None, False
        if not checked and not dist_ready():
            return
        inst = _INSTALLED
        if not inst.done:
            _install()
        stack = self._stack = _tls.stack
        if observer is not None:
            stack.append(observer)
        if inst.tls_toggled and not _dk.tls_key_included(inst.key):
            _dk.tls_set_key_included(inst.key, True)
            self._added = True

    def pop(self) -> None:
        """End the extent (idempotent; out of order only removes this observer)."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        if self._added:
            _dk.tls_set_key_included(_INSTALLED.key, False)
        observer = self.observer
        if observer is None:
            return
        if stack and stack[-1] is observer:
            stack.pop()
        else:
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is observer:
                    del stack[i]
                    break


def push_observer(observer: CollectiveObserver) -> ObserverExtent:
    """Route every collective this thread issues through ``observer`` until the
    returned extent's ``pop()`` (the caller has checked ``dist_ready()``)."""
    return ObserverExtent(observer, checked=True)


@contextlib.contextmanager
def observe_collectives(observer: CollectiveObserver) -> Iterator[CollectiveObserver]:
    """Route every collective this thread issues inside the block through ``observer``.

    Nested extents chain: the innermost observer sees a call first and its
    ``issue()`` hands the call to the next one out. Without ``torch.distributed``
    (or before it is initialised) this only runs the block.
    """
    extent = ObserverExtent(observer)
    try:
        yield observer
    except BaseException as exc:
        handler = getattr(observer, "on_extent_error", None)
        if handler is not None and extent._stack is not None:
            handler(exc)
        raise
    finally:
        extent.pop()
