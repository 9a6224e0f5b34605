"""``region``, ``name_scope``, ``recompute_needs_tensor``: named calls in a checkpoint.

A region call (:class:`_RegionCall`) reads the running checkpoint's phase from
``frame_var``: on forward it records a :class:`RegionRecord` (and, for a save
region, runs under the save region's hooks); on replay it checks that the same
region comes next, then reruns a recompute region or skips a save region, serving
its outputs from the record or as placeholders. Outside a checkpoint it is a plain
call. This module never imports :mod:`~remat_dist.core._checkpoint` (which
re-exports its public names).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from remat_dist._errors import RematError, RematUsageError
from remat_dist._torch._pytree import tree_leaves
from remat_dist.core import _compile, _record
from remat_dist.core._options import resolve
from remat_dist.core._placeholder import make_placeholder
from remat_dist.core._record import CheckpointRecord, RegionRecord
from remat_dist.core._save_region import (
    _emit_routed,
    _persist_consumed,
    _persist_if_produced,
    _record_outputs,
    _RegionInputs,
    _save_region_hooks,
)
from remat_dist.core._state import frame_var, name_prefix_var
from remat_dist.core._state_hooks import _restore, _snapshot
from remat_dist.core._types import CollectiveMode

__all__ = ["name_scope", "recompute_needs_tensor", "region"]


class _RegionCall:
    """What :func:`region` returns: each call dispatches on the checkpoint phase."""

    __slots__ = ("fn", "name", "recompute", "options", "__wrapped__")

    def __init__(
        self, fn: Callable[..., Any], name: str, recompute: bool, options: Mapping[str, Any]
    ) -> None:
        self.fn = fn
        self.name = name
        self.recompute = recompute
        self.options = options
        self.__wrapped__ = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _compile.compiling():
            return _compile.region_call(self.fn, self.name, self.recompute, args, kwargs)
        record = frame_var.get()
        if record is None:
            if _compile.fallback_active():  # a compiled checkpoint's body, run eagerly
                return _compile.fallback_region_call(
                    self.fn, self.name, self.recompute, args, kwargs
                )
            if _record._SEAMS.observers:
                return _region_plain(self, args, kwargs)
            return self.fn(*args, **kwargs)
        if record.replaying:
            return _region_replay(record, self, args, kwargs)
        return _region_forward(record, self, args, kwargs)


def region(
    function: Callable[..., Any],
    name: str,
    *,
    recompute: bool,
    collectives: CollectiveMode | None = None,
    **options: Any,
) -> Callable[..., Any]:
    """Mark a call inside a checkpoint: ``region(function, name, recompute=...)(*args)``.

    ``recompute=False`` (a kept region) keeps what the call saves for backward and
    skips the call on replay; its outputs are served to the replay from the record
    where it needs them. ``recompute=True`` reruns it (what any code in a checkpoint
    does; useful for names in traces and to persist kept-region outputs the call
    consumes). Outside a checkpoint it is a plain call.

    Args:
        function: the callable to run (a module, a function).
        name: the region's name in traces, reports and errors, unique within one
            checkpoint call (use :func:`name_scope` for repeated parts).
        recompute: ``False`` keeps what the call saves; ``True`` recomputes it.
            Required: a region says which it is.
        collectives: ``"save"`` keeps the outputs of the collectives this call
            issues, so its replay issues no communication; ``"replay"`` re-issues
            them; ``None`` (default) takes the checkpoint's mode.
        **options: further region options a layer above declared
            (``core.declare_option``).

    Returns:
        A callable with ``function``'s signature.

    Raises:
        RematUsageError: a name used twice in one checkpoint call, an empty name, a
            non-bool ``recompute``, ``recompute=True`` inside a kept region, or an
            output that is not a tensor or a flat tuple/list of tensors and None.

    Example::

        >>> def block(x):
        ...     attn = remat_dist.region(attention, "attention", recompute=False)(x)
        ...     remat_dist.recompute_needs_tensor(attn)
        ...     return mlp(x + attn)
        >>> y = remat_dist.checkpoint(region_name="layers.0")(block)(x)
    """
    # Dynamo cannot trace callable() on every callable (autograd.Function.apply):
    # under torch.compile a non-callable fails at its call instead.
    if not _compile.compiling() and not callable(function):
        raise RematUsageError(
            f"remat_dist.region(function, {name!r}, ...): region expects a function as "
            f"its first argument, got {type(function).__name__}. Fix: pass the "
            f"function or module to run, e.g. region(self.mlp, {name!r}, "
            "recompute=False)(x)."
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
    if collectives is not None:
        options["collectives"] = collectives
    resolved = resolve(options, f"remat_dist.region(fn, {name!r}, ...)", region=True)
    return _RegionCall(function, name, recompute, resolved)


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
    """``(checkpoint::prefix/name, prefix/name)`` of a region entered now."""
    local = name_prefix_var.get() + name
    return f"{record.name}::{local}", local


def _region_forward(
    record: CheckpointRecord, call: _RegionCall, args: tuple[Any, ...], kwargs: dict
) -> Any:
    """A region on the checkpoint's forward: record it, and run a save region under
    its hooks."""
    qual, local = _qualified(record, call.name)
    if not record.claim_name(qual):
        raise RematUsageError(
            f"remat_dist: Duplicate torch_remat region name {qual!r} during forward: "
            f"region {local!r} was entered twice in one forward of "
            f"checkpoint {record.name!r}. Fix: give each call its own name, or wrap "
            "repeated sub-blocks in remat_dist.name_scope('part0'), "
            "name_scope('part1'), ..."
        )
    parent = record.current_region()
    inside_save = parent is not None and (parent.inside_save or not parent.recompute)
    if call.recompute and inside_save:
        raise RematUsageError(_compile.nested_in_save(qual, parent.name))
    rr = RegionRecord(
        name=qual,
        local_name=local,
        recompute=call.recompute,
        index=len(record.regions),
        parent=None if parent is None else parent.index,
        inside_save=inside_save,
        options=call.options,
    )
    record.regions.append(rr)
    if call.recompute and record.has_producers():
        _persist_consumed(record, (args, kwargs))
    if _record._SEAMS.observers:
        _record.notify("on_region_start", record, rr, False)
    record.enter_region(rr)
    first = len(record.saved_meta)
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
        record.leave_region()
        rr.saved_span = (first, len(record.saved_meta))
    items, structure = _flatten_output(rr, out)
    _reject_fresh_leaves(record, rr, items, (args, kwargs))
    if rr.is_save:
        _record_outputs(record, rr, items, structure)
        rr.state_after = _snapshot(record, f"after save region {rr.name!r}")
    rr.descendants = len(record.regions) - rr.index - 1
    if _record._SEAMS.observers:
        _record.notify("on_region_end", record, rr, False)
    return out


def _flatten_output(rr: RegionRecord, out: Any) -> tuple[list[Any], Any]:
    """``(tensors or None, structure to rebuild with)`` of what a region returned."""
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


def _reject_fresh_leaves(
    record: CheckpointRecord, rr: RegionRecord, items: list[Any], given: Any
) -> None:
    """Refuse a requires-grad leaf output that the region did not receive.

    Every differentiable computation gives its output a ``grad_fn``, so such a
    tensor is a bare allocation (``torch.zeros(..., requires_grad=True)``): it is
    cut off from the region's inputs, and replay would build a second, unrelated
    leaf where backward expects the first. torch_remat refuses it too. Arguments
    returned as they are, and parameters, are not allocations and pass.
    """
    for j, t in enumerate(items):
        if t is None or not (t.requires_grad and t.grad_fn is None):
            continue
        if isinstance(t, torch.nn.Parameter) or any(
            t is a for a in tree_leaves(given)
        ):
            continue
        raise RematUsageError(
            f"remat_dist: region {rr.name!r} (checkpoint {record.name!r}, "
            f"recompute={rr.recompute}) returned a leaf tensor that requires grad at "
            f"output {j}: a fresh leaf (no grad_fn) created inside the region. It is "
            "not connected to the region's inputs and its replay would be another "
            "tensor. Fix: create it outside the checkpoint (e.g. as a module "
            "parameter) and pass it in, or return the result of a "
            "computation on it."
        )


def _conflicting_recompute(checkpoint: str, qual: str, on_forward: bool) -> str:
    """The error for a region whose ``recompute`` differs on replay (torch_remat's
    key phrases first: ``No save record`` is what it raises for True -> False)."""
    if on_forward:
        lead = (
            f"No save record for {qual!r} during recompute; the forward ran it with "
            "recompute=True but the replay with recompute=False (Conflicting recompute "
            "settings)"
        )
    else:
        lead = (
            f"Conflicting recompute settings for {qual!r}: the forward ran it with "
            "recompute=False but recompute runs it with recompute=True"
        )
    return (
        f"remat_dist: {lead}. The replay of checkpoint {checkpoint!r} must take the "
        "same path as its forward. Fix: compute recompute= from the inputs or the "
        "configuration only, never from remat_dist.is_recomputing() or state that "
        "changes between forward and backward."
    )


def _describe(out: Any) -> str:
    if isinstance(out, (tuple, list)):
        bad = next(x for x in out if not (x is None or isinstance(x, torch.Tensor)))
        return f"a {type(out).__name__} containing a {type(bad).__name__}"
    return f"a {type(out).__name__}"


def _region_replay(
    record: CheckpointRecord, call: _RegionCall, args: tuple[Any, ...], kwargs: dict
) -> Any:
    """A region on replay: check it is the one the forward had next, then rerun a
    recompute region or skip a save region and serve its outputs."""
    qual, _ = _qualified(record, call.name)
    expected = record.next_region()
    if expected is not None and expected.name == qual:
        if expected.recompute != call.recompute:
            raise RematError(
                _conflicting_recompute(record.name, qual, expected.recompute)
            )
    if expected is None or expected.name != qual:
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
    rr = expected
    is_save = rr.is_save
    record.advance(1 + rr.descendants if is_save else 1)  # a save region's are skipped
    if _record._SEAMS.observers:
        _record.notify("on_region_start", record, rr, True)
    if is_save:
        if rr.routed:
            _emit_routed(record, rr, call.fn, args, kwargs)
        items = [_serve(record, rr, j) for j in range(len(rr.output_meta))]
        _restore(record, rr.state_after or (), f"after save region {rr.name!r}")
        out = _rebuild(rr.output_structure, items)
    else:
        record.enter_region(rr)
        try:
            out = call.fn(*args, **kwargs)
        finally:
            record.leave_region()
    if _record._SEAMS.observers:
        _record.notify("on_region_end", record, rr, True)
    return out


def _serve(record: CheckpointRecord, rr: RegionRecord, j: int) -> torch.Tensor | None:
    """Output ``j`` of a skipped save region: persisted value, or a placeholder."""
    meta = rr.output_meta[j]
    if meta is None:
        return None
    kept = rr.persisted.get(j)
    if kept is None:
        if j in rr.released:
            raise RematError(
                f"remat_dist: the replay of checkpoint {record.name!r} needs output "
                f"{j} of save region {rr.name!r} again, but an earlier backward "
                "replayed it and freed it: that backward kept no graph and was to "
                "run every node still holding the checkpoint's saved tensors, so no "
                "later backward could replay the checkpoint (had it stopped with an "
                "error?). Fix: pass retain_graph=True to a backward that may have to "
                "run again through this graph."
            )
        return make_placeholder(meta, record.name, rr.name, j)
    t = kept.get()
    if kept.unpack is None and t._version != kept.version:
        raise RematError(
            f"remat_dist: output {j} of save region {rr.name!r} (checkpoint "
            f"{record.name!r}) was modified in place after it was kept for replay; "
            "replay would see other values than the forward did. Fix: clone it before "
            "modifying it (y = out.clone(); y.add_(...))."
        )
    if record.frees_graph:
        # The last backward that can replay the checkpoint serves it once: from
        # here the replay's own graph holds it for as long as backward needs it
        # (torch's checkpoint frees what it recomputed the same way), not the
        # record until the whole checkpoint's graph dies. Any other backward
        # leaves it for the next replay (split backward: replay_frees_graph).
        del rr.persisted[j]
        rr.released.add(j)
    t = t.detach()
    return t.requires_grad_(True) if meta[5] else t


def _rebuild(structure: Any, items: list[Any]) -> Any:
    """Undo :func:`_flatten_output`."""
    if structure is torch.Tensor:
        return items[0]
    if hasattr(structure, "_fields"):
        return structure(*items)
    return structure(items)


def recompute_needs_tensor(*tensors: torch.Tensor) -> None:
    """Keep kept-region outputs (or views of them) that code outside regions reads.

    A replay skips a kept region (``recompute=False``); code after it that reads its
    output outside any ``region`` needs the real value, not a placeholder. Call this
    right after the region, on forward. Tensors no kept region produced are left
    alone (they are recomputed anyway); outside a checkpoint's forward it does
    nothing. ``apply_remat``'s policies call it for you.

    Args:
        *tensors: outputs of kept regions, or views of them.

    Returns:
        None.

    Example::

        >>> attn = remat_dist.region(attention, "attention", recompute=False)(x)
        >>> remat_dist.recompute_needs_tensor(attn)
        >>> h = x + attn  # outside any region: reads attn on replay too
    """
    if _compile.compiling():
        return _compile.recompute_needs_tensor(tensors)
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


@contextmanager
def name_scope(prefix: str) -> Iterator[None]:
    """Prefix the region names inside the block with ``prefix/``.

    Lets one sub-block run several times inside one checkpoint without duplicate
    region names.

    Args:
        prefix: the prefix, e.g. ``"expert3"``; scopes nest (``outer/inner/name``).

    Returns:
        A context manager.

    Example::

        >>> for i, expert in enumerate(experts):
        ...     with remat_dist.name_scope(f"expert{i}"):
        ...         y = remat_dist.region(expert, "ffn", recompute=False)(x)
    """
    if not isinstance(prefix, str) or not prefix:
        raise RematUsageError(
            f"remat_dist.name_scope: prefix must be a non-empty string, got {prefix!r}."
        )
    if _compile.compiling():
        with _compile.name_scope(prefix):
            yield
        return
    token = name_prefix_var.set(f"{name_prefix_var.get()}{prefix}/")
    try:
        yield
    finally:
        name_prefix_var.reset(token)

