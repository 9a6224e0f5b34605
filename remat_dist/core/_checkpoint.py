"""``checkpoint``, ``region``, ``recompute_needs_tensor`` and ``name_scope``.

A checkpoint is non-reentrant ``torch.utils.checkpoint`` driven through its public
``context_fn`` seam: the forward context and the recompute context tell this module
which phase is running, and everything else (packing handles instead of tensors,
early stop, matching recomputed tensors) stays torch's.

Inside a checkpoint everything recomputes by default. A save region
(``region(fn, name, recompute=False)``) runs under an inner saved-tensors hook that
keeps what it saves on the original graph, so torch's checkpoint never counts those
tensors; on replay the region is skipped, which keeps the two sequences of packed
tensors aligned. Its outputs are served from the record (persisted) or as
placeholders. No dispatch mode is installed: an op inside a checkpoint costs what it
costs under ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint as torch_checkpoint

from remat_dist.core import _record, _standin
from remat_dist.core._hooks import (
    as_hooks,
    innermost_hooks,
    inputs_of_var,
    saved_name,
    saved_tensors_hooks,
)
from remat_dist.core._placeholder import make_placeholder
from remat_dist.core._record import (
    CheckpointRecord,
    PersistedOutput,
    RegionRecord,
    SavedEntry,
    plain,
    storage_key,
    storage_nbytes,
    tensor_meta,
)
from remat_dist.core._state import frame_var, name_prefix_var
from remat_dist.core._types import RecomputeStateHook, SavedTensorInfo, SavedTensorKind
from remat_dist.core.scope import active_scope_depth
from remat_dist.errors import RematError, RematUsageError

__all__ = ["checkpoint", "name_scope", "recompute_needs_tensor", "region"]

F = TypeVar("F", bound=Callable[..., Any])

RECORDS_METADATA_KEY = "remat_dist.records"
"""``grad_fn.metadata`` key of a checkpoint output's node: weak refs to records."""

COLLECTIVE_MODES = ("replay", "save", "verify")
_DETERMINISM_CHECKS = ("none", "default")


def checkpoint(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    region_name: str | None = None,
    recompute_state_hooks: Sequence[RecomputeStateHook] | None = None,
    saved_tensors_hooks: saved_tensors_hooks | tuple[Any, Any] | None = None,
    determinism_check: str = "none",
    collectives: str = "replay",
    verify_plan: bool = False,
    **unsupported: Any,
) -> Callable[[F], F]:
    """Recompute-by-default activation checkpoint: ``checkpoint(**opts)(fn)(*args)``.

    ``fn`` runs once on forward keeping only its inputs (plus what save regions
    keep), and is replayed when backward first needs one of its saved tensors,
    stopping as soon as all of them are recomputed.

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
        determinism_check: ``"none"`` or ``"default"`` (torch's metadata check of
            recomputed tensors).
        collectives: ``"replay"`` (re-issue collectives, each checked against the
            forward's ledger before it is issued), ``"save"`` (keep collective
            outputs, replay issues no communication); ``"verify"`` is accepted as
            another name of ``"replay"`` (every replay is verified). Read by
            ``remat_dist.distributed``.
        verify_plan: deprecated, no effect: with a process group every step's
            plan is agreed across ranks before its backward's first collective
            (``remat_dist.distributed``); kept for one release.
    """
    where = region_name if isinstance(region_name, str) else "<unnamed>"
    if fn is not None:
        raise RematUsageError(
            "remat_dist.checkpoint(fn) is not supported (it reads like "
            "torch.utils.checkpoint.checkpoint(fn, *args) but means something else). "
            "Fix: remat_dist.checkpoint(region_name='layers.0')(fn)(*args, **kwargs)."
        )
    if "preserve_rng_state" in unsupported:
        raise RematUsageError(
            f"remat_dist.checkpoint(region_name={where!r}): preserve_rng_state is not "
            "supported; RNG and other state are kept aligned by state hooks, "
            "restored at entry and after every save region. Fix: pass "
            "recompute_state_hooks=remat_dist.distributed.default_state_hooks() (this "
            "rank's device RNG; cpu=True adds the CPU generator) or "
            "(remat_dist.CPURNGStateHook(),)."
        )
    if unsupported:
        names = ", ".join(sorted(unsupported))
        raise RematUsageError(
            f"remat_dist.checkpoint(region_name={where!r}) got unsupported option(s) "
            f"{names}. It is always non-reentrant and drives torch's context_fn "
            "itself. Supported: region_name, recompute_state_hooks, "
            "saved_tensors_hooks, determinism_check, collectives, verify_plan."
        )
    if region_name is not None and (not isinstance(region_name, str) or not region_name):
        raise RematUsageError(
            f"remat_dist.checkpoint: region_name must be a non-empty string, got "
            f"{region_name!r}. Fix: name it after the module, e.g. 'layers.0'."
        )
    if determinism_check not in _DETERMINISM_CHECKS:
        raise RematUsageError(
            f"remat_dist.checkpoint(region_name={where!r}): determinism_check must be "
            f"one of {_DETERMINISM_CHECKS}, got {determinism_check!r}."
        )
    if collectives not in COLLECTIVE_MODES:
        raise RematUsageError(
            f"remat_dist.checkpoint(region_name={where!r}): collectives must be one of "
            f"{COLLECTIVE_MODES}, got {collectives!r}."
        )
    hooks = None if recompute_state_hooks is None else tuple(recompute_state_hooks)
    for h in hooks or ():
        if not (callable(getattr(h, "snapshot", None)) and callable(getattr(h, "restore", None))):
            raise RematUsageError(
                f"remat_dist.checkpoint(region_name={where!r}): {h!r} is not a "
                "RecomputeStateHook. Fix: give it snapshot() -> state and "
                "restore(state) methods."
            )
    if verify_plan:
        warnings.warn(
            "remat_dist.checkpoint(verify_plan=True) is deprecated and has no effect: "
            "every step's plan is agreed across ranks before backward's first "
            "collective. Drop the option (or call "
            "remat_dist.check_plan_consistency() to agree earlier).",
            DeprecationWarning,
            stacklevel=2,
        )
    options = {
        "collectives": collectives,
        "determinism_check": determinism_check,
        "saved_tensors_hooks": as_hooks(saved_tensors_hooks, where),
    }

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise RematUsageError(
                f"remat_dist.checkpoint(region_name={where!r})(fn): fn must be "
                f"callable, got {type(fn).__name__}."
            )
        name = region_name or _default_name(fn)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            return _run_checkpoint(fn, name, hooks, options, args, kwargs)

        return run  # type: ignore[return-value]

    return decorate


def _default_name(fn: Callable[..., Any]) -> str:
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _run_checkpoint(
    fn: Callable[..., Any],
    name: str,
    hooks: tuple[RecomputeStateHook, ...] | None,
    options: dict[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    outer = frame_var.get()
    if outer is not None:
        raise RematUsageError(
            f"remat_dist.checkpoint(region_name={name!r}) was entered inside checkpoint "
            f"{outer.name!r}: nested checkpoints are not supported. Fix: checkpoint "
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
        hooks = _record.default_state_hooks_for_checkpoint()
    record = CheckpointRecord(name, hooks, options)
    user_hooks = options["saved_tensors_hooks"]
    hooked = user_hooks is not None or innermost_hooks() is not None
    record.input_entries = [
        _entry(t, f"input {i}", packed_by_user_hook=hooked and i < len(args))
        for i, t in enumerate((*args, *kwargs.values()))
        if isinstance(t, torch.Tensor)
    ]
    forward_phase = _Phase(record, replay=False)
    replay_phase = _Phase(record, replay=True)
    call = functools.partial(fn, **kwargs) if kwargs else fn

    def body(*a: Any) -> Any:
        if record.pack_specs is None:
            return call(*a)
        with _standin.tracking(record):
            return call(*a)

    with user_hooks if user_hooks is not None else nullcontext():
        token = inputs_of_var.set(name)
        try:
            out = torch_checkpoint.checkpoint(
                body,
                *args,
                use_reentrant=False,
                preserve_rng_state=False,
                determinism_check=options["determinism_check"],
                context_fn=lambda: (forward_phase, replay_phase),
            )
        finally:
            inputs_of_var.reset(token)
    _link_to_graph(record, out)
    return out


def _link_to_graph(record: CheckpointRecord, out: Any) -> None:
    """Let graph walks (reports) find the record from the output nodes, weakly."""
    ref = weakref.ref(record)
    for t in torch.utils._pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            t.grad_fn.metadata.setdefault(RECORDS_METADATA_KEY, []).append(ref)


def _entry(
    t: torch.Tensor, name: str | None, *, packed_by_user_hook: bool = False
) -> SavedEntry:
    local = plain(t)
    storage = local.untyped_storage()
    return SavedEntry(
        name=name,
        shape=tuple(t.shape),
        dtype=t.dtype,
        device=local.device,
        storage=(local.device, storage._cdata),
        storage_nbytes=storage.nbytes(),
        nbytes=local.numel() * local.element_size(),
        is_parameter=isinstance(t, torch.nn.Parameter),
        packed_by_user_hook=packed_by_user_hook,
    )


def _snapshot(record: CheckpointRecord, where: str) -> tuple[Any, ...]:
    states = []
    for h in record.state_hooks:
        try:
            states.append(h.snapshot())
        except Exception as e:
            raise RematError(
                f"remat_dist: state hook {type(h).__name__}.snapshot() raised {e!r} in "
                f"checkpoint {record.name!r} ({where}). Fix the hook, or leave it out "
                "of recompute_state_hooks."
            ) from e
    return tuple(states)


def _restore(record: CheckpointRecord, states: tuple[Any, ...], where: str) -> None:
    for h, s in zip(record.state_hooks, states):
        try:
            h.restore(s)
        except Exception as e:
            raise RematError(
                f"remat_dist: state hook {type(h).__name__}.restore() raised {e!r} in "
                f"checkpoint {record.name!r} ({where}). Fix the hook, or leave it out "
                "of recompute_state_hooks."
            ) from e


class _Phase:
    """The forward or recompute context handed to torch's checkpoint.

    Reusable: torch enters the recompute context once per replay (a second
    ``retain_graph`` backward replays again).
    """

    def __init__(self, record: CheckpointRecord, replay: bool) -> None:
        self.record = record
        self.replay = replay
        self._tokens: list[Any] = []
        self._outside: tuple[Any, ...] = ()

    def __enter__(self) -> None:
        record = self.record
        self._tokens.append((frame_var.set(record), inputs_of_var.set(None)))
        record.replaying = self.replay
        try:
            if self.replay:
                record._cursor = 0
                record.replay_count += 1
                record.stopped_early = False
                # Like torch's fork_rng: replay must not disturb the state that the
                # rest of backward (and the next step) sees.
                self._outside = _snapshot(record, "replay start")
                _restore(record, record.entry_state, "checkpoint entry, replay")
            else:
                record.entry_state = _snapshot(record, "checkpoint entry")
            if _record._observers:
                _record.notify("on_checkpoint_start", record, self.replay)
        except BaseException:
            record.replaying = False
            frame_token, inputs_token = self._tokens.pop()
            inputs_of_var.reset(inputs_token)
            frame_var.reset(frame_token)
            raise

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        record = self.record
        frame_token, inputs_token = self._tokens.pop()
        absorbed = False
        try:
            if self.replay:
                record.stopped_early = exc_type is torch_checkpoint._StopRecomputationError
                if record.stopped_early:
                    exc = None
                elif (
                    exc is not None
                    and record.pack_specs is not None
                    and _record.absorbs(record, exc)
                ):
                    _standin.complete_with_stand_ins(record)
                    exc, absorbed = None, True
                _restore(record, self._outside, "replay end")
                self._outside = ()
            else:
                record.forward_done = True
                for r in record.regions:
                    r.outputs = []
                record._producers.clear()
                record._names.clear()
            record.replaying = False
            record._stack.clear()
            if _record._observers:
                _record.notify("on_checkpoint_end", record, self.replay, exc)
        finally:
            inputs_of_var.reset(inputs_token)
            frame_var.reset(frame_token)
        return absorbed


class _RegionCall:
    __slots__ = ("fn", "name", "recompute", "collectives", "__wrapped__")

    def __init__(
        self, fn: Callable[..., Any], name: str, recompute: bool, collectives: str | None
    ) -> None:
        self.fn = fn
        self.name = name
        self.recompute = recompute
        self.collectives = collectives
        self.__wrapped__ = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        record = frame_var.get()
        if record is None:
            if _record._observers:
                return _region_plain(self, args, kwargs)
            return self.fn(*args, **kwargs)
        if record.replaying:
            return _region_replay(record, self, args, kwargs)
        return _region_forward(record, self, args, kwargs)


def region(
    fn: Callable[..., Any],
    name: str,
    *,
    recompute: bool,
    collectives: str | None = None,
) -> Callable[..., Any]:
    """Mark a call inside a checkpoint: ``region(fn, name, recompute=...)(*args)``.

    ``recompute=False`` (a save region) keeps what the call saves for backward on the
    original graph and skips the call on replay; its outputs are served to replay
    from the record where replay needs them. ``recompute=True`` reruns it (the
    default for any code in a checkpoint; useful for names in traces and to persist
    save-region outputs the call consumes). Outside a checkpoint: a plain call.

    ``collectives="save"`` keeps the outputs of the collectives this call issues, so
    that its replay issues no communication (the checkpoint's ``collectives=``
    option, for this region only; read by ``remat_dist.distributed``).
    """
    if not callable(fn):
        raise RematUsageError(
            f"remat_dist.region(fn, {name!r}, ...): fn must be callable, got "
            f"{type(fn).__name__}."
        )
    if not isinstance(name, str) or not name:
        raise RematUsageError(
            f"remat_dist.region: name must be a non-empty string, got {name!r}. Fix: "
            "name the call after what it computes, e.g. 'attention'."
        )
    if not isinstance(recompute, bool):
        raise RematUsageError(
            f"remat_dist.region(fn, {name!r}, recompute=...): recompute must be True "
            f"or False, got {recompute!r} ({type(recompute).__name__})."
        )
    if collectives not in (None, "replay", "save"):
        raise RematUsageError(
            f"remat_dist.region(fn, {name!r}, collectives=...): must be None, 'replay' "
            f"or 'save', got {collectives!r}."
        )
    return _RegionCall(fn, name, recompute, collectives)


def _region_plain(call: _RegionCall, args: tuple[Any, ...], kwargs: dict) -> Any:
    """A region outside any checkpoint: a plain call, announced to observers
    (traces) with ``record=None``."""
    local = name_prefix_var.get() + call.name
    rr = RegionRecord(local, local, call.recompute, -1, None, False)
    _record.notify("on_region_start", None, rr, False)
    try:
        return call.fn(*args, **kwargs)
    finally:
        _record.notify("on_region_end", None, rr, False)


def _qualified(record: CheckpointRecord, name: str) -> tuple[str, str]:
    local = name_prefix_var.get() + name
    return f"{record.name}::{local}", local


def _region_forward(
    record: CheckpointRecord, call: _RegionCall, args: tuple[Any, ...], kwargs: dict
) -> Any:
    qual, local = _qualified(record, call.name)
    if qual in record._names:
        raise RematUsageError(
            f"remat_dist: region {local!r} was entered twice in one forward of "
            f"checkpoint {record.name!r}. Fix: give each call its own name, or wrap "
            "repeated sub-blocks in remat_dist.name_scope('part0'), "
            "name_scope('part1'), ..."
        )
    parent = record._stack[-1] if record._stack else None
    inside_save = parent is not None and (parent.inside_save or not parent.recompute)
    if call.recompute and inside_save:
        raise RematUsageError(
            f"remat_dist: region {qual!r} (recompute=True) is nested inside save region "
            f"{parent.name!r}, whose body is never replayed. Fix: move the recompute "
            "region out of the save region, or make it recompute=False."
        )
    rr = RegionRecord(
        name=qual,
        local_name=local,
        recompute=call.recompute,
        index=len(record.regions),
        parent=None if parent is None else parent.index,
        inside_save=inside_save,
        collectives=call.collectives,
    )
    record.regions.append(rr)
    record._names.add(qual)
    if call.recompute and record._producers:
        _persist_consumed(record, (args, kwargs))
    if _record._observers:
        _record.notify("on_region_start", record, rr, False)
    record._stack.append(rr)
    try:
        if rr.is_save:
            inputs = _RegionInputs(record, args, kwargs)
            try:
                with _save_region_hooks(record, rr, inputs):
                    out = call.fn(*args, **kwargs)
            finally:
                # autograd keeps the pack hook as long as the saved tensors:
                # it must not keep the region's inputs alive
                inputs.clear()
        else:
            out = call.fn(*args, **kwargs)
    finally:
        record._stack.pop()
    items, structure = _flatten_output(rr, out)
    if rr.is_save:
        _record_outputs(record, rr, items, structure)
        rr.state_after = _snapshot(record, f"after save region {rr.name!r}")
    rr.descendants = len(record.regions) - rr.index - 1
    if _record._observers:
        _record.notify("on_region_end", record, rr, False)
    return out


def _flatten_output(rr: RegionRecord, out: Any) -> tuple[list[Any], Any]:
    if isinstance(out, torch.Tensor):
        return [out], torch.Tensor
    if isinstance(out, (tuple, list)) and all(
        x is None or isinstance(x, torch.Tensor) for x in out
    ):
        return list(out), type(out)
    raise RematUsageError(
        f"remat_dist: region {rr.name!r} returned {_describe(out)}; a region must "
        "return a tensor, or one tuple/list of tensors and None. Fix: return a tuple "
        "of tensors and build dicts or nested structures outside the region."
    )


def _describe(out: Any) -> str:
    if isinstance(out, (tuple, list)):
        bad = next(x for x in out if not (x is None or isinstance(x, torch.Tensor)))
        return f"a {type(out).__name__} containing a {type(bad).__name__}"
    return f"a {type(out).__name__}"


class _Kept:
    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor = tensor
        self.version = version


class _UserPacked:
    __slots__ = ("hooks", "packed")

    def __init__(self, hooks: saved_tensors_hooks, packed: Any) -> None:
        self.hooks = hooks
        self.packed = packed


_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def _checkpoint_hooks_below() -> tuple[Any, Any] | None:
    """torch's checkpoint pack/unpack hooks, when they are the innermost ones."""
    hooks = _top_hooks(False)
    if hooks is None:
        return None
    if not (
        getattr(hooks[0], "__qualname__", "").startswith("_checkpoint_hook.")
        or _standin.is_tracker(hooks[0])
    ):
        return None  # another hook sits in between: keep everything
    return hooks


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Storage element range ``[first, last]`` that ``t`` covers."""
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.storage_offset(), last


class _RegionInputs:
    """The region's plain-tensor arguments that replay recomputes, by storage."""

    def __init__(self, record: CheckpointRecord, args: tuple[Any, ...], kwargs: dict):
        self.by_storage: dict[Any, list[tuple[int, torch.Tensor, int]]] = {}
        for i, a in enumerate(torch.utils._pytree.tree_leaves((args, kwargs))):
            if type(a) is not torch.Tensor or a.numel() == 0 or not a.is_contiguous():
                continue
            key = storage_key(a)
            if key in record._producers:
                continue  # a skipped save region's output: replay may not have it
            self.by_storage.setdefault(key, []).append((i, a, a._version))

    def clear(self) -> None:
        self.by_storage.clear()

    def find(self, t: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        if type(t) is not torch.Tensor or t.numel() == 0:
            return None
        first, last = _extent(t)
        for i, a, version in self.by_storage.get(storage_key(t), ()):
            lo, hi = _extent(a)
            if t._version != version:
                return None  # changed in place inside the region: replay would not
            if a.dtype == t.dtype and lo <= first and last <= hi:
                return i, a
        return None


def _save_region_hooks(
    record: CheckpointRecord, rr: RegionRecord, inputs: _RegionInputs
) -> torch.autograd.graph.saved_tensors_hooks:
    user = innermost_hooks()
    below = _checkpoint_hooks_below()

    def pack(t: torch.Tensor) -> Any:
        if below is not None:
            hit = inputs.find(t)
            if hit is not None:
                # A (view of a) region input that replay recomputes anyway: let
                # torch's checkpoint recompute it instead of keeping it. On replay
                # the skipped region emits the same pack (see _emit_routed).
                i, a = hit
                rr.routed.append(
                    (i, tuple(a.shape), a.stride(), tuple(t.shape), t.stride(),
                     t.storage_offset() - a.storage_offset())
                )
                return below[0](t)
        name = saved_name(t)
        entry = _entry(t, name)
        entry.packed_by_user_hook = user is not None
        rr.saved.append(entry)
        if user is None:
            # detach: a tensor that is the op's own output would otherwise hold its
            # grad_fn, a reference cycle through the saved variable.
            return _Kept(t.detach(), t._version)
        info = SavedTensorInfo(SavedTensorKind.BACKWARD, record.name, rr.name, name)
        return _UserPacked(user, user.pack_with(t, info))

    def unpack(p: Any) -> torch.Tensor:
        if isinstance(p, _UserPacked):
            return p.hooks.unpack_with(p.packed)
        if not isinstance(p, _Kept):
            return below[1](p)  # routed to torch's checkpoint: recomputed
        t = p.tensor
        if t._version != p.version:
            # autograd skips its own version check for hooked saves; do it here.
            raise RematError(
                "one of the variables needed for gradient computation has been "
                f"modified by an inplace operation: [{t.dtype}, {tuple(t.shape)}], "
                f"saved by save region {rr.name!r} (checkpoint {record.name!r}), is at "
                f"version {t._version}; expected version {p.version} instead. Fix: "
                "clone the tensor before modifying it in place."
            )
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _emit_routed(
    record: CheckpointRecord, rr: RegionRecord, args: tuple[Any, ...], kwargs: dict
) -> None:
    """On replay, where a save region is skipped: hand torch's recompute hook the
    region inputs that the forward routed to it, in the same order, rebuilt from
    this replay's (recomputed) arguments."""
    hooks = _top_hooks(False)
    flat = torch.utils._pytree.tree_leaves((args, kwargs))
    with torch.no_grad():
        for i, a_shape, a_stride, shape, stride, rel in rr.routed:
            a = flat[i] if i < len(flat) else None
            if (
                hooks is None
                or not isinstance(a, torch.Tensor)
                or tuple(a.shape) != a_shape
                or a.stride() != a_stride
            ):
                raise RematError(
                    f"remat_dist: the replay of checkpoint {record.name!r} reached save "
                    f"region {rr.name!r} with other inputs than the forward (input {i}: "
                    f"expected shape {a_shape} strides {a_stride}). The checkpointed "
                    "function must compute the same inputs on replay."
                )
            hooks[0](a.as_strided(shape, stride, a.storage_offset() + rel))


def _record_outputs(
    record: CheckpointRecord, rr: RegionRecord, items: list[Any], structure: Any
) -> None:
    rr.output_structure = structure
    rr.outputs = items
    kept = {e.storage for e in rr.saved if not e.packed_by_user_hook}
    for j, t in enumerate(items):
        if t is None:
            rr.output_meta.append(None)
            rr.output_versions.append(0)
            continue
        rr.output_meta.append(tensor_meta(t))
        rr.output_versions.append(t._version)
        if t.numel() == 0:
            rr.persisted[j] = PersistedOutput(t.detach(), None, t._version, 0, True)
            continue
        key = storage_key(t)
        if key in kept:
            # Backward keeps this storage anyway: persisting it costs nothing.
            rr.persisted[j] = PersistedOutput(t.detach(), None, t._version, 0, True)
        else:
            record._producers.setdefault(key, (rr, j))


def _persist_consumed(record: CheckpointRecord, tree: Any) -> None:
    for t in torch.utils._pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            _persist_if_produced(record, t)


def _persist_if_produced(record: CheckpointRecord, t: torch.Tensor) -> None:
    if t.numel() == 0:
        return
    hit = record._producers.get(storage_key(t))
    if hit is None:
        return
    rr, j = hit
    if j in rr.persisted:
        return
    out = rr.outputs[j]
    if out._version != rr.output_versions[j]:
        raise RematError(
            f"remat_dist: output {j} of save region {rr.name!r} was modified in place "
            "after the region returned, and replay needs it. Replay would see other "
            "values than the forward did. Fix: clone it before modifying "
            "(y = out.clone(); y.add_(...)) or modify it inside the region."
        )
    user = innermost_hooks()
    nbytes = storage_nbytes(out)
    if user is None:
        rr.persisted[j] = PersistedOutput(out.detach(), None, out._version, nbytes, False)
    else:
        info = SavedTensorInfo(SavedTensorKind.SAVE_OUTPUT, record.name, rr.name, None)
        packed = user.pack_with(out.detach(), info)
        rr.persisted[j] = PersistedOutput(
            packed, user.unpack_with, out._version, nbytes, False
        )


def recompute_needs_tensor(*tensors: torch.Tensor) -> None:
    """Persist save-region outputs (or views of them) that bare code consumes.

    Replay skips a save region; code after it that reads its output outside any
    ``region`` needs the real value, not a placeholder. Call this right after the
    region on forward. Tensors not produced by a save region are left alone (they
    are recomputed anyway); outside a checkpoint forward this is a no-op.
    """
    record = frame_var.get()
    if record is None or record.replaying or record.forward_done:
        return
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise RematUsageError(
                f"remat_dist.recompute_needs_tensor: expected tensors, got "
                f"{type(t).__name__} (in checkpoint {record.name!r})."
            )
        _persist_if_produced(record, t)


def _region_replay(
    record: CheckpointRecord, call: _RegionCall, args: tuple[Any, ...], kwargs: dict
) -> Any:
    qual, _ = _qualified(record, call.name)
    cursor = record._cursor
    expected = record.regions[cursor] if cursor < len(record.regions) else None
    if expected is None or expected.name != qual or expected.recompute != call.recompute:
        what = (
            "no more regions"
            if expected is None
            else f"region {expected.name!r} (recompute={expected.recompute})"
        )
        raise RematError(
            f"remat_dist: the replay of checkpoint {record.name!r} entered region "
            f"{qual!r} (recompute={call.recompute}) where the forward had {what}. "
            "The checkpointed function must take the same path on replay. Fix: make "
            "control flow depend only on the inputs, or branch on "
            "remat_dist.is_recomputing() only around code that is not a region."
        )
    record._cursor += 1
    rr = expected
    if _record._observers:
        _record.notify("on_region_start", record, rr, True)
    if rr.is_save:
        record._cursor += rr.descendants
        if rr.routed:
            _emit_routed(record, rr, args, kwargs)
        items = [_serve(record, rr, j) for j in range(len(rr.output_meta))]
        _restore(record, rr.state_after or (), f"after save region {rr.name!r}")
        out = _rebuild(rr.output_structure, items)
    else:
        record._stack.append(rr)
        try:
            out = call.fn(*args, **kwargs)
        finally:
            record._stack.pop()
    if _record._observers:
        _record.notify("on_region_end", record, rr, True)
    return out


def _serve(record: CheckpointRecord, rr: RegionRecord, j: int) -> torch.Tensor | None:
    meta = rr.output_meta[j]
    if meta is None:
        return None
    kept = rr.persisted.get(j)
    if kept is None:
        return make_placeholder(meta, record.name, rr.name, j)
    t = kept.get()
    if kept.unpack is None and t._version != kept.version:
        raise RematError(
            f"remat_dist: output {j} of save region {rr.name!r} (checkpoint "
            f"{record.name!r}) was modified in place after it was kept for replay; "
            "replay would see other values than the forward did. Fix: clone it before "
            "modifying it (y = out.clone(); y.add_(...))."
        )
    t = t.detach()
    return t.requires_grad_(True) if meta[5] else t


def _rebuild(structure: Any, items: list[Any]) -> Any:
    if structure is torch.Tensor:
        return items[0]
    if hasattr(structure, "_fields"):
        return structure(*items)
    return structure(items)


@contextmanager
def name_scope(prefix: str) -> Iterator[None]:
    """Prefix region names inside the block (``prefix/name``).

    Lets one sub-block run several times inside one checkpoint without duplicate
    region names::

        for i, expert in enumerate(experts):
            with remat_dist.name_scope(f"expert{i}"):
                y = remat_dist.region(expert, "ffn", recompute=False)(x)
    """
    if not isinstance(prefix, str) or not prefix:
        raise RematUsageError(
            f"remat_dist.name_scope: prefix must be a non-empty string, got {prefix!r}."
        )
    token = name_prefix_var.set(f"{name_prefix_var.get()}{prefix}/")
    try:
        yield
    finally:
        name_prefix_var.reset(token)
