"""Completing a failed replay with stand-ins, so that backward can go on.

An observer may *absorb* an exception raised inside a replay
(``CheckpointObserver.on_replay_error`` returns True). The core then hands torch's
recompute hook a zero-filled stand-in, of the forward's shape, strides, dtype,
device and tensor subclass, for every saved tensor the replay did not recompute,
and backward continues on this process with wrong values. This exists for
``remat_dist.distributed``: a rank whose replay fails must keep issuing the same
collectives as its peers until all of them can raise together; an observer that
absorbs an error must make sure the step fails later.

The stand-ins need each saved tensor's metadata, which torch's own checkpoint pack
hook notes on forward through the metadata function remat_dist registers with it
(:func:`saved_meta`, kept in ``record.saved_meta``: no hook of ours runs per saved
tensor on forward). On replay a pack hook pushed just above torch's counts the
tensors the replay recomputes and checks each against the forward's
(``_replay_check``, for every checkpoint).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from remat_dist._torch import _autograd
from remat_dist._torch._checkpoint import (
    StopRecomputationError,
    frame_of_pack_hook,
    register_metadata_fn,
)
from remat_dist.core import _fingerprint
from remat_dist.core._replay_check import check_replayed

if TYPE_CHECKING:
    from remat_dist.core._record import CheckpointRecord

__all__ = [
    "Tracking",
    "complete_with_stand_ins",
    "is_tracker",
    "note_forward",
    "pack_spec",
    "saved_meta",
]

_top_hooks = _autograd.top_saved_tensors_hooks
_push_hooks = _autograd.push_saved_tensors_hooks
_pop_hooks = _autograd.pop_saved_tensors_hooks
_OPAQUE = object()
_STRIDED = torch.strided
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def pack_spec(t: Any) -> tuple[Any, ...]:
    """What a stand-in for ``t`` needs: subclass structure, shape, strides, dtype
    (an inner attribute that is not a tensor, such as a DTensor's mesh, is kept)."""
    if not isinstance(t, torch.Tensor):
        return (_OPAQUE, t)
    flatten = getattr(t, "__tensor_flatten__", None)
    if type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter) or flatten is None:
        return (None, tuple(t.shape), t.stride(), t.dtype, t.device)
    names, ctx = flatten()
    inner = {n: pack_spec(getattr(t, n)) for n in names}
    return (type(t), ctx, inner, tuple(t.shape), t.stride())


def make_stand_in(spec: tuple[Any, ...]) -> Any:
    cls = spec[0]
    if cls is _OPAQUE:
        return spec[1]
    if cls is None:
        _, shape, stride, dtype, device = spec
        return torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()
    _, ctx, inner, shape, stride = spec
    tensors = {n: make_stand_in(s) for n, s in inner.items()}
    return cls.__tensor_unflatten__(tensors, ctx, shape, stride)


def is_tracker(pack: Any) -> bool:
    return getattr(pack, "_remat_tracker", False)


def saved_meta(t: torch.Tensor) -> tuple[Any, ...]:
    """What the forward notes of each tensor torch's checkpoint saves (torch's own
    pack hook calls it, :data:`METADATA_MODE`): shape, dtype, device, and the
    strides of a plain tensor or, for a tensor subclass, its :func:`pack_spec`."""
    if t.layout is _STRIDED and type(t) in _PLAIN:
        return (t.shape, t.dtype, t.device, t.stride(), None)
    return (t.shape, t.dtype, t.device, None, pack_spec(t))


register_metadata_fn(saved_meta)


def note_forward(record: CheckpointRecord) -> None:
    """At a checkpoint's forward start (torch's pack hook innermost): its frame's
    metadata list becomes ``record.saved_meta``, and the check of the replay is
    remat_dist's (torch's own after the replay is turned off)."""
    hooks = _top_hooks(False)
    frame = None if hooks is None else frame_of_pack_hook(hooks[0])
    if frame is not None:
        frame.ignore_saved_mismatch = True
        record.saved_meta = frame.x_metadatas


class Tracking:
    """Inside torch's checkpoint hook, on replay: check each saved tensor against
    the forward's (``_replay_check``) and count them; on a forward, only when the
    value check is on (the metadata is noted by torch's own hook,
    :func:`saved_meta`).

    A plain class pushing the hook pair itself: it runs twice per checkpoint, and
    its pack once per saved tensor, so it stays as short as Python allows."""

    __slots__ = ("record", "pushed")

    def __init__(self, record: CheckpointRecord) -> None:
        self.record = record
        self.pushed = False

    def __enter__(self) -> None:
        record = self.record
        replaying = record.replaying
        if not (replaying or record.values_check):
            return
        below = _top_hooks(False)
        if below is None:
            return
        pack_below, unpack_below = below
        if replaying:
            meta = record.saved_meta
            record.replay_packs = 0
            forward = len(meta)

            def pack(t: torch.Tensor) -> Any:
                index = record.replay_packs
                if index < forward:  # more than forward: torch's own error says so
                    want = meta[index]
                    if t.shape != want[0] or t.dtype != want[1] or t.device != want[2]:
                        check_replayed(record, index, t)
                record.replay_packs = index + 1
                return pack_below(t)

        else:
            pack = pack_below
        if record.values_check:
            pack = _fingerprint.wrap_pack(record, pack)
        pack._remat_tracker = True  # type: ignore[attr-defined]
        _push_hooks(pack, unpack_below)
        self.pushed = True

    def __exit__(self, *exc: Any) -> None:
        if self.pushed:
            self.pushed = False
            _pop_hooks()


def _stand_in(meta: tuple[Any, ...]) -> Any:
    shape, dtype, device, stride, spec = meta[:5]
    if spec is not None:
        return make_stand_in(spec)
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()


def complete_with_stand_ins(record: CheckpointRecord) -> None:
    """Hand torch's recompute hook a stand-in for every saved tensor this replay did
    not recompute (runs inside the recompute context, after the replay raised)."""
    hooks = _top_hooks(False)
    if hooks is None:
        return
    with torch.no_grad():
        try:
            for meta in record.saved_meta[record.replay_packs :]:
                hooks[0](_stand_in(meta))
                record.replay_packs += 1
        except StopRecomputationError:
            pass
