"""Checking that a replay does what its forward did, saved tensor by saved tensor.

Every tensor torch's checkpoint saves in a checkpoint's forward passes the core's
tracking hook (``_standin.Tracking``), which notes its shape, dtype, device and
strides in ``record.saved_meta``. The replay's saves
pass the same hook in the same order, and the first one that differs raises
:class:`~remat_dist.ReplayMismatchError` at once: before the different
tensor reaches model code that would fail deep inside with a shape error (a KV
cache appended to again on replay), or backward computes wrong gradients from it
without a word (a dtype that changed). A replay that ends having saved fewer
tensors than its forward is refused the same way (:func:`short_replay`). Any other
exception raised inside a replay keeps its type and gets a note naming the
checkpoint and the likely causes (:func:`annotate`).

Cost: one Python call per saved tensor, on forward and on replay (torch's own
checkpoint hook already makes one per saved tensor).
"""

from __future__ import annotations

import linecache
import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from remat_dist._errors import RematError, ReplayMismatchError

if TYPE_CHECKING:
    from remat_dist.core._record import CheckpointRecord

__all__ = ["annotate", "check_replayed", "short_replay"]

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
    differs from the forward's in shape, dtype or device."""
    want = record.saved_meta[index]
    if t.shape == want[0] and t.dtype == want[1] and t.device == want[2]:
        return
    raise ReplayMismatchError(_message(record, index, want, _with_op(t)))


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
) -> str:
    region = record._stack[-1].name if record._stack else None
    inside = f" in region {region!r}" if region else ""
    where = _user_frame()
    at = f"\n  saved at {where}" if where else ""
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


def _user_frame() -> str | None:
    """``file:line in function: source`` of the innermost frame outside torch,
    remat_dist's core and the standard library's wrappers: the model code whose op
    saved the tensor."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_SKIP):
            line = linecache.getline(path, frame.f_lineno).strip()
            text = f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
            return f"{text}: {line}" if line else text
        frame = frame.f_back
    return None
