"""``checkpoint``: the decorator, its options, and the two phases of one checkpoint.

A checkpoint is non-reentrant ``torch.utils.checkpoint`` driven through its public
``context_fn`` seam: the forward context and the recompute context (:class:`_Phase`)
tell the rest of core which phase is running, and everything else (packing handles
instead of tensors, early stop, matching recomputed tensors) stays torch's.

Inside a checkpoint everything recomputes by default. A save region
(``region(fn, name, recompute=False)``) runs under an inner saved-tensors hook that
keeps what it saves on the original graph, so torch's checkpoint never counts those
tensors; on replay the region is skipped, which keeps the two sequences of packed
tensors aligned. Its outputs are served from the record (persisted) or as
placeholders. No dispatch mode is installed: an op inside a checkpoint costs what it
costs under ``torch.utils.checkpoint``.

The pieces live by concern: regions in :mod:`~remat_dist.core._region`, the save
region's hooks and output bookkeeping in :mod:`~remat_dist.core._save_region`, what
core leaves on the autograd graph in :mod:`~remat_dist.core._packed`, and state-hook
calls in :mod:`~remat_dist.core._state_hooks`, options in
:mod:`~remat_dist.core._options`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from remat_dist._errors import RematUsageError
from remat_dist._torch import _autograd
from remat_dist._torch._checkpoint import StopRecomputationError, run_checkpoint
from remat_dist._torch._pytree import tree_leaves
from remat_dist.core import _compile, _fingerprint, _record, _replay_check, _standin
from remat_dist.core._hooks import (
    as_hooks,
    entry_hooks,
    innermost_hooks,
    inputs_of_var,
    saved_tensors_hooks,
)
from remat_dist.core._options import (
    CheckpointOptions,
    DeterminismCheck,
    TorchDeterminismCheck,
    determinism_mode,
    resolve,
)
from remat_dist.core._packed import _link_to_graph
from remat_dist.core._record import _SEAMS, CheckpointPhase, CheckpointRecord
from remat_dist.core._save_region import note_forward, replay_frees_graph
from remat_dist.core._scope import active_scope_depth
from remat_dist.core._state import frame_var, hooks_var
from remat_dist.core._state_hooks import _restore, _snapshot
from remat_dist.core._types import CollectiveMode, RecomputeStateHook

__all__ = ["checkpoint"]

F = TypeVar("F", bound=Callable[..., Any])



class _UnsupportedOption(RematUsageError, NotImplementedError):
    """``preserve_rng_state=True``, nested checkpoints: a ``NotImplementedError`` as
    torch_remat raises (what its users catch), and a ``RematUsageError`` like every
    other misuse."""


def _positional_call_message(fn: Any, args: tuple, region_name: Any) -> str:
    """The error for ``checkpoint(fn, *args)``: torch's call shape, spelled our way."""
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name.isidentifier():
        name = "block"  # a module instance or a partial
    inputs = "x" if len(args) == 1 else ", ".join(f"x{i}" for i in range(len(args))) or "*args"
    region = region_name if isinstance(region_name, str) and region_name else "layers.0"
    call = "(" + ", ".join([name, *(["..."] if args else [])]) + ")"
    return (
        f"remat_dist.checkpoint{call} is torch.utils.checkpoint.checkpoint's call "
        "shape; remat_dist.checkpoint takes only keyword options and returns a "
        f"decorator. Write: remat_dist.checkpoint(region_name={region!r})({name})"
        f"({inputs})"
    )


def checkpoint(
    fn: Callable[..., Any] | None = None,
    /,
    *args: Any,
    region_name: str | None = None,
    recompute_state_hooks: Sequence[RecomputeStateHook] | None = None,
    saved_tensors_hooks: saved_tensors_hooks | tuple[Any, Any] | None = None,
    determinism_check: DeterminismCheck | TorchDeterminismCheck = "metadata",
    preserve_rng_state: bool = False,
    collectives: CollectiveMode | None = None,
    **options: Any,
) -> Callable[[F], F]:
    """Recompute-by-default activation checkpoint: ``checkpoint(**opts)(fn)(*args)``.

    ``fn`` runs once on forward keeping only its inputs (plus what save regions
    keep), and is replayed when backward first needs one of its saved tensors,
    stopping as soon as all of them are recomputed.

    ``checkpoint(fn, *args)``, ``torch.utils.checkpoint.checkpoint``'s call shape,
    raises :class:`RematUsageError` (a ``TypeError``) showing the call to write.

    Args:
        region_name: the checkpoint's name in errors, traces and reports
            (torchtitan-style ``layers.0``). Defaults to ``fn``'s name.
        recompute_state_hooks: :class:`RecomputeStateHook` s kept aligned across
            replay (RNG generators, counters). ``None`` (default) takes the
            default set installed by ``remat_dist.distributed``: this rank's RNG
            (``default_state_hooks()``) with a process group, the CPU generator
            (plus an initialised accelerator's) in a single process, so dropout
            replays exactly. Pass ``()`` for none at all.
        saved_tensors_hooks: hooks applied to what this checkpoint keeps: its
            inputs, save-region saves and persisted outputs.
        determinism_check: ``"metadata"``, ``"metadata_per_tensor"`` or
            ``"values"``. Every replay's saved tensors are checked against the
            forward's shape, dtype and device before backward uses them; the
            first that differs raises ``ReplayMismatchError`` (a
            ``CheckpointError``) naming the checkpoint, the region and both
            metadata. ``"metadata"`` (default) checks them in one loop when the
            replay ends (or raises inside model code: the error then names the
            model line where it failed, and comes from it);
            ``"metadata_per_tensor"`` checks each as the replay saves it, so the
            replay stops there and the error names the model line that saved it,
            at the cost of a Python call per saved tensor between the replay's
            kernels. ``"values"`` adds to ``"metadata_per_tensor"``: each tensor
            the replay saves,
            and the input of each collective it re-issues, is compared with a
            fingerprint taken on forward (an on-device integer hash, no copy
            kept); a difference raises ``ReplayValueMismatchError`` at the end of
            backward (on every rank of the replay group). ``REMAT_DIST_DETERMINISM_CHECK=values``
            in the environment turns it on for every checkpoint of the process.
            See ``docs/distributed.md``. torch's names are accepted for code
            written against ``torch.utils.checkpoint`` or torch_remat: ``"none"``
            means ``"metadata"``, ``"default"`` means ``"metadata_per_tensor"``.
        preserve_rng_state: ``False`` only, torch_remat's default, accepted so that
            code written for torch_remat (torchtitan passes it explicitly) runs
            unchanged. It adds nothing: RNG replays through
            ``recompute_state_hooks`` (the default set above already keeps it
            aligned). ``True`` raises ``NotImplementedError`` as in torch_remat
            (also a ``RematUsageError``), naming the state hooks to pass instead.
        collectives: ``"replay"`` (default with a process group: re-issue each
            collective on replay, checked against the forward's ledger before it is
            issued) or ``"save"`` (keep the collectives' outputs so the replay
            issues no communication); see ``docs/distributed.md``.
        **options: further options a layer above declared
            (``core.declare_option``, the extension interface).

    Returns:
        A decorator: ``checkpoint(**opts)(fn)`` is a function with ``fn``'s
        signature that runs ``fn`` checkpointed.

    Raises:
        RematUsageError: an unknown option, a bad value, a positional argument
            (``checkpoint(fn, x)``), or a checkpoint nested in another.

    Example::

        >>> block = torch.nn.Linear(4, 4)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> y = remat_dist.checkpoint(region_name="layers.0")(block)(x)
        >>> y.sum().backward()
    """
    where = region_name if isinstance(region_name, str) else "<unnamed>"
    if fn is not None or args:
        raise RematUsageError(_positional_call_message(fn, args, region_name))
    if preserve_rng_state is not False:
        if not isinstance(preserve_rng_state, bool):
            raise RematUsageError(
                f"remat_dist.checkpoint(region_name={where!r}): preserve_rng_state "
                f"must be False, got {preserve_rng_state!r}. Fix: leave it out; RNG "
                "replays through recompute_state_hooks."
            )
        raise _UnsupportedOption(
            f"remat_dist.checkpoint(region_name={where!r}) does not preserve torch's "
            "RNG state (preserve_rng_state must be False, torch_remat's default; "
            "torch_remat refuses True too). RNG and other state are kept aligned by state hooks, "
            "restored at entry and after every save region. Fix: pass "
            "recompute_state_hooks=remat_dist.distributed.default_state_hooks() (this "
            "rank's device RNG; cpu=True adds the CPU generator) or "
            "(remat_dist.distributed.CPURNGStateHook(),)."
        )
    if region_name is not None and (not isinstance(region_name, str) or not region_name):
        raise RematUsageError(
            f"remat_dist.checkpoint: region_name must be a non-empty string, got "
            f"{region_name!r}. Fix: name it after the module, e.g. 'layers.0'."
        )
    mode = determinism_mode(determinism_check, f"remat_dist.checkpoint(region_name={where!r})")
    hooks = None if recompute_state_hooks is None else tuple(recompute_state_hooks)
    for h in hooks or ():
        if not (callable(getattr(h, "snapshot", None)) and callable(getattr(h, "restore", None))):
            raise RematUsageError(
                f"remat_dist.checkpoint(region_name={where!r}): {h!r} is not a "
                "RecomputeStateHook. Fix: give it snapshot() -> state and "
                "restore(state) methods."
            )
    if collectives is not None:
        options["collectives"] = collectives
    extensions = resolve(
        options,
        f"remat_dist.checkpoint(region_name={where!r})",
        region=False,
        hint=" It is always non-reentrant and drives torch's context_fn itself.",
    )
    frozen = CheckpointOptions(
        determinism_check=mode,
        saved_tensors_hooks=as_hooks(saved_tensors_hooks, where),
        extensions=extensions,
    )

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise RematUsageError(
                f"remat_dist.checkpoint(region_name={where!r})(fn): fn must be "
                f"callable, got {type(fn).__name__}."
            )
        name = region_name or _default_name(fn)
        site = _standin.SaveSite()

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if _compile.compiling():  # Dynamo cannot trace the contextvars below
                return _compile.run_checkpoint(fn, name, hooks, frozen, args, kwargs)
            return _run_checkpoint(fn, name, hooks, frozen, args, kwargs, site)

        return run  # type: ignore[return-value]

    return decorate


def _default_name(fn: Callable[..., Any]) -> str:
    """The checkpoint's name when ``region_name`` is not given."""
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _run_checkpoint(
    fn: Callable[..., Any],
    name: str,
    hooks: tuple[RecomputeStateHook, ...] | None,
    options: CheckpointOptions,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    site: _standin.SaveSite,
) -> Any:
    """One call of a checkpointed function: refuse nesting, build its record, and
    run it through torch's non-reentrant checkpoint with the two :class:`_Phase` s
    (``site``: what this call site's forwards saved before)."""
    record = frame_var.get()
    outer = record.name if record is not None else _compile.fallback_name()
    if outer is not None:
        raise _UnsupportedOption(
            f"remat_dist.checkpoint(region_name={name!r}) was entered inside checkpoint "
            f"{outer!r}: nested checkpoints are not supported. Fix: checkpoint "
            "the outer block only and mark the inner call with "
            f"remat_dist.region(fn, {name!r}, recompute=True), or checkpoint the "
            "inner blocks one by one instead of the outer one."
        )
    if active_scope_depth():
        raise RematUsageError(
            f"remat_dist.checkpoint(region_name={name!r}) was entered inside a "
            "remat_dist.gradient_checkpoint_scope(). Everything created in the scope "
            "is recomputed already. Fix: call the checkpoint outside the scope, or "
            "drop the scope around it."
        )
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if hooks is None:
        hooks = _SEAMS.hooks_provider()
    record = CheckpointRecord(name, hooks, options)
    record.values_check = _fingerprint.values_check_enabled(options)
    user_hooks = options.saved_tensors_hooks
    kept_under = entry_hooks(user_hooks)
    hooked = kept_under is not None
    record.note_inputs(fn, args, kwargs, hooked=hooked)
    forward_phase = _Phase(record, replay=False, site=site)
    replay_phase = _Phase(record, replay=True)
    call = functools.partial(fn, **kwargs) if kwargs else fn

    anchors: list[Any] = []
    if hooked:

        def body(*a: Any) -> Any:
            # replay packs the anchor again first, filling the forward's holder
            anchor = _ReplayAnchor.apply(torch.empty(0, requires_grad=True))
            if not record.replaying:
                anchors.append(anchor)
            return call(*a)

    else:
        body = call

    if user_hooks is not None:
        user_hooks.__enter__()
    # a plain torch pair nested inside the user's hooks takes over: what the save
    # regions keep goes to it too
    pushed = hooks_var.set(hooks_var.get() + (kept_under,)) if (
        hooked and innermost_hooks() is not kept_under
    ) else None
    token = inputs_of_var.set(name)
    first_node = _autograd.sequence_counter()
    try:
        out = run_checkpoint(
            body,
            *args,
            preserve_rng_state=False,
            # torch notes each saved tensor's metadata for remat_dist, which
            # checks the replay itself (_replay_check, _fingerprint)
            determinism_check=site.mode,
            context_fn=lambda: (forward_phase, replay_phase),
        )
    except BaseException:
        # the anchor's saved tensor reaches torch's frame, which holds body and
        # so this list: a cycle through autograd's C++ that gc cannot collect
        anchors.clear()
        raise
    finally:
        inputs_of_var.reset(token)
        if pushed is not None:
            hooks_var.reset(pushed)
        if user_hooks is not None:
            user_hooks.__exit__(None, None, None)
    if anchors:
        _replay_first(anchors.pop(), out)
    _link_to_graph(record, out)
    if record.regions:
        note_forward(record, out, first_node, hooked)
    return out


class _ReplayAnchor(torch.autograd.Function):
    """The checkpoint's first saved tensor (empty): unpacking it starts the replay,
    which goes as far as without it (torch's early stop)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(anchor)
        return anchor.view_as(anchor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        return grad


def _replay_first(anchor: Any, out: Any) -> None:
    """Under user saved-tensor hooks, start the checkpoint's backward with its whole
    replay (torch_remat's timing): before any node of the checkpoint runs, a
    pre-hook on its output nodes unpacks the anchor, the first tensor packed under
    torch's checkpoint hook. So no user unpack of what the checkpoint keeps comes
    before the replay, and an offloader can prepare at the replay's start.

    The anchor is dropped once unpacked: its node never runs in backward, so its
    saved tensor (torch's holder, whose unpack reaches torch's checkpoint frame and
    so the checkpoint's inputs) would otherwise live as long as the output nodes,
    after backward too, while the caller keeps the loss. A second backward through
    a graph kept with ``retain_graph=True`` therefore starts its replay at its
    first unpack, as torch's checkpoint does.

    The anchor tensor is held, not only its node: on torch 2.11 and 2.12 a custom
    Function's node (and with it its saved tensors) lives only as long as its
    output tensor; its Python object does not keep it alive."""
    held = [anchor]

    def prehook(grad_outputs: Any) -> None:
        if held:
            anchor = held.pop()  # alive across the unpack (torch 2.11, 2.12)
            anchor.grad_fn.saved_tensors  # noqa: B018 - the unpack is the point

    nodes = {
        id(node): node
        for t in tree_leaves(out)
        if isinstance(t, torch.Tensor) and (node := t.grad_fn) is not None
    }
    for node in nodes.values():
        node.register_prehook(prehook)


class _Phase:
    """The forward or recompute context handed to torch's checkpoint.

    Reusable: torch enters the recompute context once per replay (a second
    ``retain_graph`` backward replays again). Its ``__exit__`` ends the forward
    (:meth:`_forward_end`) or dispatches a replay to one of its three outcomes:
    :meth:`_replay_clean`, :meth:`_replay_absorbed`, :meth:`_replay_raised`.
    """

    __slots__ = (
        "record", "replay", "_site", "_tokens", "_outside", "_forward_done",
        "_tracker", "_target",
    )

    def __init__(
        self, record: CheckpointRecord, replay: bool, site: _standin.SaveSite | None = None
    ) -> None:
        self.record = record
        self.replay = replay
        self._site = site
        self._tokens: list[Any] = []
        self._outside: tuple[Any, ...] = ()
        self._forward_done = False
        self._tracker: _standin.Tracking | None = None
        self._target: tuple[Any, Any] | None = None
        """The frame and graph task of the running replay (torch's), when its
        saved tensors are checked at its end."""

    def __enter__(self) -> None:
        record = self.record
        self._tokens.append((frame_var.set(record), inputs_of_var.set(None)))
        if self.replay:
            self._forward_done = record.start_replay()
        try:
            if self.replay:
                if record.forward_graph is not None:  # torch's hook still innermost
                    record.frees_graph = replay_frees_graph(record)
                # Like torch's fork_rng: replay must not disturb the state that the
                # rest of backward (and the next step) sees.
                self._outside = _snapshot(record, "replay start")
                _restore(record, record.entry_state, "checkpoint entry, replay")
            else:
                _standin.note_forward(record)
                record.entry_state = _snapshot(record, "checkpoint entry")
            for method in _SEAMS.starts[record.values_check]:
                method(record, self.replay)
            # innermost: a replay's saved tensors are checked as they are saved
            # (and a forward's fingerprinted, with the value check on) by a hook
            # above torch's; otherwise all at once when the replay ends
            target = None
            if self.replay and not record.values_check:
                if record.options.determinism_check != "metadata_per_tensor":
                    target = self._target = _standin.replay_target_here()
            if record.values_check or (self.replay and target is None):
                # (no frame to read at the end: torch's hook is not innermost)
                tracker = self._tracker = _standin.Tracking(record)
                tracker.__enter__()
        except BaseException:
            if self.replay:
                record.phase = CheckpointPhase.REPLAY_FAILED
            frame_token, inputs_token = self._tokens.pop()
            inputs_of_var.reset(inputs_token)
            frame_var.reset(frame_token)
            raise

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        """End the phase. A replay has one of three outcomes: no error (it ran to
        its end, or torch stopped it early with ``StopRecomputationError``), an
        error an observer absorbs, an error raised. The error is the model's, or
        the mismatch the end-of-replay check found (which comes first). Returns
        True only for an absorbed error: torch then goes on with the stand-ins."""
        frame_token, inputs_token = self._tokens.pop()
        tracker, self._tracker = self._tracker, None
        target, self._target = self._target, None
        try:
            if tracker is not None:
                tracker.__exit__()
            if not self.replay:
                self._forward_end(exc)
                return False
            stopped = exc_type is StopRecomputationError
            raised = None if stopped else exc
            mismatch = self._check_at_end(target, raised)
            error = raised if mismatch is None else mismatch
            if error is None:
                return self._replay_clean(stopped)
            if _record.absorbs(self.record, error):
                return self._replay_absorbed(raised, mismatch, target)
            return self._replay_raised(raised, mismatch)
        finally:
            inputs_of_var.reset(inputs_token)
            frame_var.reset(frame_token)

    def _forward_end(self, error: BaseException | None) -> None:
        """The forward ended (``error``: what it raised). The record drops what
        only the forward needed; a forward that completed teaches its call site
        what it saved (``SaveSite.learn``: the next forward notes it cheaper)."""
        record = self.record
        record.end_forward()
        if error is None and self._site is not None:
            self._site.learn(record)
        for method in _SEAMS.ends[record.values_check]:
            method(record, False, error)

    def _check_at_end(
        self, target: tuple[Any, Any] | None, raised: BaseException | None
    ) -> BaseException | None:
        """With the check at the replay's end (``target``: torch's frame and graph
        task, its hook innermost): count what the replay saved and compare it with
        the forward's shapes, dtypes and devices. Returns the mismatch, which
        explains the model's error ``raised`` when there is one (a wrong shape
        fails in model code first). Nothing is checked after an interrupt (a
        ``BaseException`` that is no ``Exception``)."""
        if target is None:
            return None
        record = self.record
        record.replay_packs = target[0].recomp_counter.get(target[1], 0)
        if raised is not None and not isinstance(raised, Exception):
            return None
        return _replay_check.check_after_replay(record, target, raised)

    def _replay_clean(self, stopped: bool) -> bool:
        """The replay raised nothing: it ran to the function's end, or torch's
        early stop (``stopped``) ended it once backward had all it needed (torch
        catches that). Two checks may still fail it, raising here: a replay that
        ran to its end saving fewer tensors than a finished forward
        (``short_replay``), and the value check (``determinism_check="values"``)
        when its difference cannot wait for backward's end."""
        record = self.record
        error = None
        if not stopped and self._forward_done:
            error = _replay_check.short_replay(record)
        if error is None and record.values_check:
            error = _fingerprint.replay_done(record)
        if error is not None:
            self._replay_end(CheckpointPhase.REPLAY_FAILED, error)
            raise error
        self._replay_end(
            CheckpointPhase.STOPPED_EARLY if stopped else CheckpointPhase.REPLAYED, None
        )
        return False

    def _replay_absorbed(
        self,
        raised: BaseException | None,
        mismatch: BaseException | None,
        target: tuple[Any, Any] | None,
    ) -> bool:
        """An observer absorbed the replay's error (it makes the step fail later,
        on every rank of the replay group): instead of what the replay saved wrong
        (``mismatch``) and what it did not get to save (``raised`` stopped it),
        backward reads zero stand-ins of the forward's metadata. Returns True so
        that torch, whose recompute this context runs, swallows the error and
        backward goes on."""
        record = self.record
        if mismatch is not None:
            _standin.replace_mismatched(record, target)
        if raised is not None:
            _standin.complete_with_stand_ins(record)
        self._replay_end(CheckpointPhase.REPLAY_FAILED, None)
        return True

    def _replay_raised(
        self, raised: BaseException | None, mismatch: BaseException | None
    ) -> bool:
        """The replay's error goes to the caller. A mismatch found at the end is
        raised here (it names the checkpoint and region); the model's own error is
        annotated with the checkpoint and left for torch to raise on (False)."""
        if mismatch is not None:
            self._replay_end(CheckpointPhase.REPLAY_FAILED, mismatch)
            raise mismatch
        assert raised is not None
        _replay_check.annotate(self.record, raised)
        self._replay_end(CheckpointPhase.REPLAY_FAILED, raised)
        return False

    def _replay_end(self, phase: CheckpointPhase, error: BaseException | None) -> None:
        """What every replay outcome ends with: the state hooks give back the
        state from before the replay (still inside torch's recompute), the record
        takes ``phase``, and the observers hear of the end with the ``error``
        that goes on (None when there is none or it was absorbed)."""
        record = self.record
        _restore(record, self._outside, "replay end")
        self._outside = ()
        record.end_replay(phase)
        for method in _SEAMS.ends[record.values_check]:
            method(record, True, error)
