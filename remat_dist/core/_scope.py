"""``gradient_checkpoint_scope``: mark what to recompute instead of what to keep.

RETURNN's API (``returnn.torch.util.gradient_checkpoint``)::

    with gradient_checkpoint_scope():
        x = a + b          # x is not stored for backward
    y = x * c              # ... even though this op, outside the scope, needs x
    y.sum().backward()     # x = a + b is recomputed here

``torch.utils.checkpoint`` asks for a function whose *outputs* are kept and whose
inside is recomputed; here the user names the tensors not to keep, wherever they
are used. Everything a scope produces is left out of autograd's saved tensors and
recomputed the first time backward needs it, then freed again. What the scope
keeps is only what replay needs: the tensors it read from outside, RNG snapshots
before random draws, copies of outside tensors it wrote in place.

Differences from RETURNN, each covered by a test:

* any number of scopes may be alive at once, nested or one after another; all of
  them protect their tensors;
* no saved-tensor hook is left installed once the scope has exited: later uses of
  a scope output push the hook for the one operator that consumes it (see
  :mod:`remat_dist.core._scope_output`), so ``torch.utils.checkpoint`` and plain
  backward in the same thread are unaffected;
* replayed tensors never outlive the backward pass that recomputed them (also with
  ``retain_graph=True``);
* the scope is context-local: scopes in two threads do not see each other.

Interplay with :func:`remat_dist.checkpoint`: a scope entered inside a checkpoint
(forward or replay) does nothing, since the checkpoint recomputes its region
already (and a save region inside it keeps what it is told to keep). A checkpoint
entered inside a scope is refused by the checkpoint (it reads
:func:`active_scope_depth`). ``torch.utils.checkpoint`` works both inside a scope
and around one.

Double backward (``create_graph=True``) works: autograd attaches a recomputed
tensor to the graph node it was saved from.

Limits: eager mode only (not under ``torch.compile``). Kept as usual (correct, no
memory saved): tensors without a storage (sparse, nested) or of other tensor
subclasses (DTensor), and scope outputs that a custom ``autograd.Function`` saves
after the scope (``Function.apply`` does not go through ``__torch_function__``). A
scope entered with gradients disabled does nothing.
"""

from __future__ import annotations

import threading
from contextvars import Token
from types import TracebackType
from typing import Any

import torch

from remat_dist._errors import RematUsageError
from remat_dist._torch import _autograd
from remat_dist._torch._tensor import (
    TorchDispatchMode,
    current_dispatch_modes,
    pop_dispatch_mode,
    push_dispatch_mode,
)
from remat_dist.core import _state
from remat_dist.core._record import _SEAMS
from remat_dist.core._scope_hooks import PackHooks, is_our_hook
from remat_dist.core._scope_output import ScopeOutput
from remat_dist.core._scope_record import ScopeRecord, live_scope_records
from remat_dist.core._scope_tags import ACTIVE, FLAGS, Active

__all__ = [
    "ScopeOutput",
    "ScopeRecord",
    "active_scope_depth",
    "gradient_checkpoint_scope",
    "live_scope_records",
]

_top_hooks = _autograd.top_saved_tensors_hooks
_push_hooks = _autograd.push_saved_tensors_hooks
_pop_hooks = _autograd.pop_saved_tensors_hooks


def active_scope_depth() -> int:
    """How many ``gradient_checkpoint_scope`` blocks are recording in this context.

    0 outside any scope. Nested scopes count one each (they share their outermost
    scope's record). Scopes that do nothing (entered inside a
    :func:`remat_dist.checkpoint`, or with gradients disabled) are not counted.
    :func:`remat_dist.checkpoint` calls this at entry to refuse running inside a
    scope.
    """
    active = ACTIVE.get()
    if active is None or active.thread != threading.get_ident():
        return 0
    return active.depth


class _RecordMode(TorchDispatchMode):
    """Hands every ATen call made in the scope's context to the record."""

    def __init__(self, record: ScopeRecord) -> None:
        super().__init__()
        self.record = record

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # No torch._dynamo.disable wrapper around every call: a scope records
        # eager code only, and the wrapper costs microseconds per operator.
        return False

    def __torch_dispatch__(
        self,
        func: Any,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if FLAGS.bypass or FLAGS.replaying:
            return func(*args, **kwargs)
        active = ACTIVE.get()
        if active is None or active.record is not self.record:
            # Another context (an asyncio task) sharing this thread's mode stack.
            return func(*args, **kwargs)
        return self.record.record_op(func, args, kwargs)


class gradient_checkpoint_scope:  # noqa: N801 - RETURNN's name
    """Context manager: tensors created inside are recomputed, not stored (RETURNN's API).

    Every tensor an operator creates in the ``with`` block is left out of what
    autograd saves for backward, also when an operator after the block saves it; the
    first time backward needs it, the recorded operators it depends on are rerun
    (with the RNG state and autocast state they ran under) and the result is freed
    again once the backward pass no longer needs it. Gradients are bitwise equal to
    running without the scope, and so is the RNG state after the step. A scope object
    can be entered once.

    The context manager's value is the scope itself; :attr:`record` (a
    :class:`ScopeRecord`, shared with enclosing scopes) tells what is kept for the
    recompute.

    Example::

        >>> with remat_dist.gradient_checkpoint_scope() as scope:
        ...     noisy_w = w + torch.randn_like(w) * 0.01
        >>> y = x @ noisy_w               # noisy_w is not stored for backward
        >>> print(scope.kept_bytes())     # the RNG snapshot (w is a leaf: alive anyway)
    """

    def __init__(self) -> None:
        self.record: ScopeRecord | None = None
        """The record of the outermost scope this one belongs to; None when the
        scope does nothing (inside a checkpoint, or gradients disabled)."""
        self._entered = False
        self._token: Token[Active | None] | None = None
        self._mode: _RecordMode | None = None
        self._hooks: PackHooks | None = None
        self._extent: Any = None

    def kept_bytes(self) -> int:
        """``self.record.kept_bytes()``, 0 when the scope recorded nothing."""
        return self.record.kept_bytes() if self.record is not None else 0

    def __enter__(self) -> gradient_checkpoint_scope:
        if self._entered:
            raise RematUsageError(
                "This gradient_checkpoint_scope object was entered already. Fix: "
                "create a new one for each `with` block: "
                "`with gradient_checkpoint_scope(): ...`."
            )
        self._entered = True
        if torch.compiler.is_compiling():
            _refuse_compile()
        if (
            _state.current_frame() is not None
            or not torch.is_grad_enabled()
            or torch.is_inference_mode_enabled()
        ):
            return self
        if not _autograd.saved_tensors_hooks_enabled():
            raise RematUsageError(
                "gradient_checkpoint_scope() needs saved-tensor hooks, which are "
                "disabled here (torch.autograd.graph.disable_saved_tensors_hooks: "
                f"{_autograd.saved_tensors_hooks_disabled_message()}"
                "). Fix: enter the scope outside the region that disables them."
            )
        thread = threading.get_ident()
        outer = ACTIVE.get()
        if outer is not None and outer.thread == thread:
            record = outer.record
            depth = outer.depth + 1
        else:
            record = ScopeRecord()
            depth = 1
            self._mode = _RecordMode(record)
        top = _top_hooks(True)
        # A nested scope directly inside its parent reuses the parent's hook; one
        # under some other hook (torch.utils.checkpoint...) pushes its own on top.
        if not (is_our_hook(top) and top[0].__self__.record is record):
            self._hooks = PackHooks(record, None, top)
            _push_hooks(self._hooks.pack, PackHooks.unpack)
            opener = _SEAMS.hooks_extent  # collectives go out without the hooks
            if opener is not None:
                self._extent = opener()
        self.record = record
        self._token = ACTIVE.set(Active(record, depth, thread))
        if self._mode is not None:
            self._mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is None:
            return
        token, self._token = self._token, None
        misplaced = []
        extent, self._extent = self._extent, None
        if extent is not None:
            extent.pop()
        try:
            if self._mode is not None and not _remove_mode(self._mode):
                misplaced.append("a TorchDispatchMode")
            if self._hooks is not None and not _remove_hooks(self._hooks):
                misplaced.append("a saved_tensors_hooks context")
        finally:
            try:
                ACTIVE.reset(token)
            except ValueError:
                ACTIVE.set(None)
            if self._mode is not None:
                self._mode = None
                self.record.finish()  # type: ignore[union-attr]
            self._hooks = None
        if misplaced and exc_type is None:
            raise RematUsageError(
                f"gradient_checkpoint_scope() exited while {' and '.join(misplaced)} "
                "entered inside it was still active. Fix: exit everything entered "
                "inside the scope before the scope ends (use `with` blocks)."
            )


def _refuse_compile() -> None:
    """A scope met by ``torch.compile``: refuse at trace time (never run wrong)."""
    from remat_dist.core._compile import refuse

    refuse(
        "remat_dist.gradient_checkpoint_scope() is not supported under "
        "torch.compile: it records every ATen call through a TorchDispatchMode and "
        "recomputes from saved-tensor hooks at backward time, and a compiled graph "
        "runs neither. Fix: use remat_dist.checkpoint(region_name=...)(fn) (compiles "
        "into one graph) for the code in the scope, or keep the scope out of the "
        "compiled region (torch.compiler.disable on the function that enters it)."
    )


def _remove_mode(mode: TorchDispatchMode) -> bool:
    """Pop ``mode``; True if it was on top (else the modes above are put back)."""
    stack = current_dispatch_modes()
    if stack and stack[-1] is mode:
        mode.__exit__(None, None, None)
        return True
    if not any(m is mode for m in stack):
        return False
    above = []
    while True:
        m = pop_dispatch_mode()
        if m is mode:
            break
        above.append(m)
    for m in reversed(above):
        push_dispatch_mode(m)
    return False


def _remove_hooks(hooks: PackHooks) -> bool:
    """Pop the scope's hook pair; True if it was on top (else others are kept)."""
    above = []
    try:
        while True:
            top = _top_hooks(True)
            if top is None:
                return False
            if getattr(top[0], "__self__", None) is hooks:
                _pop_hooks()
                return not above
            above.append(top)
            _pop_hooks()
    finally:
        for pack, unpack in reversed(above):
            _push_hooks(pack, unpack)
