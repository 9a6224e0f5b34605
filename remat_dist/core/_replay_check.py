"""Checking that a replay does what its forward did, saved tensor by saved tensor.

Every tensor torch's checkpoint saves in a checkpoint's forward has its shape,
dtype and device noted by torch's own pack hook (``record.saved_meta``, through the
metadata function ``_standin`` registers). When a replay ends, before backward
uses anything it recomputed, :func:`check_after_replay` compares what it saved with
those notes in one loop, and the first tensor that differs raises
:class:`~remat_dist.errors.ReplayMismatchError`: backward never computes wrong gradients
from it without a word (a dtype that changed), and a replay that failed inside
model code because of it (a KV cache appended to again on replay) raises this
error, from the model's. With ``determinism_check="metadata_per_tensor"`` each tensor is
checked as the replay saves it instead (:func:`check_replayed`, through
``_standin.Tracking``), so the error comes before the next op runs and names the
model line that saved the tensor. A replay that ends having saved fewer tensors
than its forward is refused the same way (:func:`short_replay`). Any other
exception raised inside a replay keeps its type and gets a note naming the
checkpoint and the likely causes (:func:`annotate`).

Cost: by default one loop per replay over what it saved, after it (torch's own
check, which is off, is such a loop too); with ``"metadata_per_tensor"`` one Python call per
saved tensor while the replay runs, between its kernels.
"""

from __future__ import annotations

import linecache
import operator
import os
import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch

from remat_dist._errors import RematError, ReplayMismatchError

if TYPE_CHECKING:
    from remat_dist.core._record import CheckpointRecord

__all__ = ["annotate", "check_after_replay", "check_replayed", "short_replay"]

_NOTED = "_remat_dist_replay_note"

CAUSES = (
    "Something the checkpointed code reads changed between its forward and its "
    "replay in backward. Likely causes, with the fix:\n"
    "  - a cache the block appends to on every call (a transformers KV cache with "
    "use_cache=True, a Python list): turn it off for training (use_cache=False; "
    "remat_dist.apply_remat does it for transformers models), or skip the update "
    "while remat_dist.is_recomputing();\n"
    "  - a counter or a Python flag the block changes on each call: keep it aligned "
    "with recompute_state_hooks=(..., YourHook()) (a RecomputeStateHook whose "
    "snapshot()/restore() save and put back that state), or guard the change with "
    "remat_dist.is_recomputing();\n"
    "  - a parameter, buffer or input changed in place between forward and "
    "backward (an optimizer step or a no_grad update before backward): run "
    "backward first."
)


def _with_op(t: torch.Tensor) -> tuple[Any, ...]:
    node = t.grad_fn
    return (
        t.shape,
        t.dtype,
        t.device,
        None,
        None,
        None if node is None else type(node).__name__,
    )


def check_replayed(record: CheckpointRecord, index: int, t: torch.Tensor) -> None:
    """Raise :class:`ReplayMismatchError` when the replay's saved tensor ``index``
    differs from the forward's in shape, dtype or device (called as the replay
    saves it: the region running and the model line are those that saved it)."""
    want = record.saved_meta[index]
    if t.shape == want[0] and t.dtype == want[1] and t.device == want[2]:
        return
    running = record.current_region()
    region = None if running is None else running.name
    where = _user_frame()
    at = f"\n  saved at {where}" if where else ""
    raise ReplayMismatchError(_message(record, index, want, _with_op(t), region, at))


def replayed_tensors(
    record: CheckpointRecord, target: tuple[Any, Any]
) -> list[tuple[int, Any, torch.Tensor]]:
    """``(index, handle, tensor)`` of every tensor the replay of ``target`` (torch's
    frame and graph task, ``_torch._checkpoint.replay_target``) saved and still
    holds for backward, in the order it saved them."""
    frame, gid = target
    recomputed = frame.recomputed.get(gid)
    if recomputed is None:
        return []
    data = recomputed.data  # a WeakKeyDictionary's dict: read without a call per key
    holders = frame.weak_holders
    done = min(frame.recomp_counter.get(gid, 0), len(record.saved_meta), len(holders))
    out = []
    for index in range(done):
        holder = holders[index]()
        handle = None if holder is None else holder.handles.get(gid)
        if handle is not None:
            t = data.get(_ref(handle))
            if t is not None:
                out.append((index, handle, t))
    return out


def check_after_replay(
    record: CheckpointRecord, target: tuple[Any, Any], raised: BaseException | None
) -> ReplayMismatchError | None:
    """The error for the first tensor the replay of ``target`` saved with another
    shape, dtype or device than its forward (None when all match). ``raised``: the
    exception the replay ended with, if any (the error then comes from it)."""
    meta = record.saved_meta
    frame, gid = target
    recomputed = frame.recomputed.get(gid)
    done = frame.recomp_counter.get(gid, 0)
    if recomputed is not None and done <= len(meta):
        kept = recomputed.data  # a WeakKeyDictionary's dict, in the order saved
        if len(kept) == done:  # every tensor kept: the values line up with meta
            # C loops only: this runs once per replay, between its kernels
            got = list(map(_SHAPE_DTYPE_DEVICE, kept.values()))
            if got == list(map(_FIRST3, meta[:done])):
                return None
    for index, _, t in replayed_tensors(record, target):
        want = meta[index]
        if t.shape == want[0] and t.dtype == want[1] and t.device == want[2]:
            continue
        after = ""
        if raised is not None:
            site = _raise_site(raised)
            at = f"\n    at {site}" if site else ""
            name = type(raised).__name__
            after = f"\n  found when the replay raised {name}: {raised}{at}"
        # the replay's tensors are kept detached: no node to name the op by
        got_meta = (t.shape, t.dtype, t.device)
        region = _region_of(record, index)
        error = ReplayMismatchError(
            _message(record, index, want, got_meta, region, after)
            + "\nTo stop the replay at that tensor and name the model line that saved "
            "it: determinism_check='metadata_per_tensor' (a check per saved tensor as the "
            "replay runs)."
        )
        if raised is not None:
            error.__cause__ = raised
        return error
    return None


def _region_of(record: CheckpointRecord, index: int) -> str | None:
    """The innermost region whose forward saved tensor ``index`` (regions are in
    pre-order: the last one whose span holds it)."""
    name = None
    for r in record.regions:
        span = r.saved_span
        if span is not None and span[0] <= index < span[1]:
            name = r.name
    return name


_ref = weakref.ref
_SHAPE_DTYPE_DEVICE = operator.attrgetter("shape", "dtype", "device")
_FIRST3 = operator.itemgetter(0, 1, 2)


def short_replay(record: CheckpointRecord) -> ReplayMismatchError | None:
    """The error for a replay that ran to its end having saved fewer tensors than
    its forward (None when it saved as many)."""
    done, want = record.replay_packs, len(record.saved_meta)
    if done >= want:
        return None
    return ReplayMismatchError(
        f"remat_dist: the replay of checkpoint {record.name!r} did not reproduce its "
        f"forward: it ran to its end having saved {done} tensor(s) for backward where "
        f"the forward saved {want}; the first one missing is saved tensor #{done} "
        f"({_describe(record.saved_meta[done])}). The replay took another path "
        f"through the code.\n{CAUSES}"
    )


def annotate(record: CheckpointRecord, exc: BaseException) -> None:
    """Add a note to an exception raised inside ``record``'s replay (not to
    remat_dist's own errors, which say all this already). Its type is kept."""
    if isinstance(exc, RematError) or not isinstance(exc, Exception):
        return
    if getattr(exc, _NOTED, False) or not hasattr(exc, "add_note"):
        return  # Python 3.10 has no notes
    try:
        setattr(exc, _NOTED, True)
    except Exception:  # pragma: no cover - an exception type with __slots__
        return
    exc.add_note(
        f"remat_dist: raised while replaying checkpoint {record.name!r} in backward "
        "(its forward ran without this error), so the replay did not do what the "
        f"forward did.\n{CAUSES}"
    )


def _describe(meta: tuple[Any, ...]) -> str:
    shape, dtype, device = meta[:3]
    made = ""
    if len(meta) > 5:
        made = f", made by {meta[5]}" if meta[5] is not None else ", a leaf tensor"
    return f"shape {tuple(shape)}, dtype {dtype}, device {device}{made}"


def _message(
    record: CheckpointRecord,
    index: int,
    want: tuple[Any, ...],
    got: tuple[Any, ...],
    region: str | None,
    at: str,
) -> str:
    inside = f" in region {region!r}" if region else ""
    what = [n for n, a, b in zip(("shape", "dtype", "device"), want, got) if a != b]
    return (
        f"remat_dist: the replay of checkpoint {record.name!r} did not reproduce its "
        f"forward: saved tensor #{index}{inside} has another {' and '.join(what)} "
        f"than on forward.{at}\n"
        f"  forward: {_describe(want)}\n"
        f"  replay:  {_describe(got)}\n"
        f"{CAUSES}"
    )


_SKIP = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.__file__) + os.sep + "contextlib.py",
    os.path.dirname(os.__file__) + os.sep + "functools.py",
)


def _raise_site(exc: BaseException) -> str | None:
    """``file:line in function: source`` of the innermost frame of ``exc``'s
    traceback outside torch, remat_dist's core and the standard library's
    wrappers: the model line where the replay failed."""
    site = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        path = os.path.abspath(code.co_filename)
        if not path.startswith(_SKIP):
            site = _where(path, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    return site


def _where(path: str, lineno: int, function: str) -> str:
    line = linecache.getline(path, lineno).strip()
    text = f"{path}:{lineno} in {function}"
    return f"{text}: {line}" if line else text


def _user_frame() -> str | None:
    """``file:line in function: source`` of the innermost frame outside torch,
    remat_dist's core and the standard library's wrappers: the model code whose op
    saved the tensor."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_SKIP):
            return _where(path, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return None
