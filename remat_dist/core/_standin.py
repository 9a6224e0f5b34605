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
tensor on forward). After its first forward a checkpoint notes less, in one C call
per tensor (:class:`SaveSite`): a plain tensor's stand-in needs only its shape,
dtype and device, and a tensor subclass's structure (a DTensor's placements) is
taken from the last forward that noted it in full, while the kinds of tensors
saved stay the same. A replay's tensors are checked against the forward's when it
ends (``_replay_check``, reading them from torch's frame: :func:`replay_target_here`),
or, with ``determinism_check="metadata_per_tensor"``, by a pack hook pushed just above torch's
that counts and checks each as it is saved (:class:`Tracking`).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from remat_dist._errors import RematError
from remat_dist._torch import _autograd
from remat_dist._torch._checkpoint import (
    METADATA_MODE,
    METADATA_MODE_PLAIN,
    StopRecomputationError,
    frame_of_pack_hook,
    register_metadata_fn,
    replay_target,
)
from remat_dist.core import _fingerprint
from remat_dist.core._replay_check import check_replayed, replayed_tensors

if TYPE_CHECKING:
    from remat_dist.core._record import CheckpointRecord

__all__ = [
    "SaveSite",
    "Tracking",
    "complete_with_stand_ins",
    "is_tracker",
    "note_forward",
    "pack_spec",
    "replace_mismatched",
    "replay_target_here",
    "saved_meta",
    "saved_meta_plain",
]

_top_hooks = _autograd.top_saved_tensors_hooks
_push_hooks = _autograd.push_saved_tensors_hooks
_pop_hooks = _autograd.pop_saved_tensors_hooks
_OPAQUE = object()
_STRIDED = torch.strided
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_TYPES = frozenset(_PLAIN)
_CLASS = operator.itemgetter(3)


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


saved_meta_plain = operator.attrgetter("shape", "dtype", "device", "__class__")
"""What :data:`METADATA_MODE_PLAIN` notes: shape, dtype, device and class, in one C
call (a stand-in is then a contiguous zero tensor)."""

register_metadata_fn(saved_meta)
register_metadata_fn(saved_meta_plain, METADATA_MODE_PLAIN)


class SaveSite:
    """What the forwards of one checkpoint call site (a ``checkpoint(...)(fn)``)
    saved: whose metadata function its next forward hands torch (``mode``).

    The first forward notes full metadata (:func:`saved_meta`); later forwards
    note the plain one (:data:`saved_meta_plain`: shape, dtype, device, class, in
    one C call). A site that saves tensor subclasses keeps the full metadata of
    its last full forward (``specs``): a later forward that saved the same kinds
    (equal plain metadata at every position) builds its stand-ins from it. A
    forward that saved other kinds makes the next one note full metadata again;
    it has no stand-in for a subclass it saved anew, so a failed replay of it
    raises instead of completing (:func:`complete_with_stand_ins`)."""

    __slots__ = ("mode", "specs", "kinds")

    def __init__(self) -> None:
        self.mode = METADATA_MODE
        self.specs: Sequence[tuple[Any, ...]] | None = None
        self.kinds: list[tuple[Any, ...]] | None = None

    def learn(self, record: CheckpointRecord) -> None:
        """Choose the next forward's mode from what ``record``'s forward saved, and
        give the record the full metadata its stand-ins need."""
        metas = record.saved_meta
        if self.mode is METADATA_MODE:
            self.mode = METADATA_MODE_PLAIN
            subclass = any(m[4] is not None for m in metas)
            self.specs, self.kinds = (metas if subclass else None), None
            return
        specs = self.specs
        if specs is None:
            if not _PLAIN_TYPES.issuperset(map(_CLASS, metas)):
                self.mode = METADATA_MODE
            return
        if metas == self.kinds or (self.kinds is None and _same_kinds(metas, specs)):
            self.kinds = metas if self.kinds is None else self.kinds
            record.saved_specs = specs
        else:
            self.mode, self.specs, self.kinds = METADATA_MODE, None, None


def _same_kinds(plain: Sequence[tuple[Any, ...]], full: Sequence[tuple[Any, ...]]) -> bool:
    """Whether plain metadata (shape, dtype, device, class) describes, position by
    position, the tensors that full metadata was noted of."""
    if len(plain) != len(full):
        return False
    for (shape, dtype, device, cls), want in zip(plain, full):
        if (shape, dtype, device) != tuple(want[:3]):
            return False
        spec = want[4]
        if spec is None:  # a plain strided tensor
            if cls not in _PLAIN_TYPES:
                return False
        elif spec[0] is None:  # no structure to rebuild: its stand-in is plain
            if getattr(cls, "__tensor_flatten__", None) is not None:
                return False
        elif cls is not spec[0]:
            return False
    return True


def note_forward(record: CheckpointRecord) -> None:
    """At a checkpoint's forward start (torch's pack hook innermost): its frame's
    metadata list becomes ``record.saved_meta``, and the check of the replay is
    remat_dist's (torch's own after the replay is turned off)."""
    hooks = _top_hooks(False)
    frame = None if hooks is None else frame_of_pack_hook(hooks[0])
    if frame is not None:
        frame.ignore_saved_mismatch = True
        record.saved_meta = frame.x_metadatas


def replay_target_here() -> tuple[Any, Any] | None:
    """At a replay's start (torch's recomputation hook innermost): the frame being
    replayed and the graph task, whose saved tensors ``_replay_check`` checks when
    the replay ends."""
    hooks = _top_hooks(False)
    return None if hooks is None else replay_target(hooks[0])


class Tracking:
    """Inside torch's checkpoint hook: on a replay with ``determinism_check=
    "metadata_per_tensor"`` or the value check, check each saved tensor against the forward's
    as it is saved (``_replay_check``) and count them; on a forward, only when the
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

            if forward and len(meta[0]) == 4:  # METADATA_MODE_PLAIN: one C call
                noted = saved_meta_plain

                def pack(t: torch.Tensor) -> Any:
                    index = record.replay_packs
                    if index < forward and noted(t) != meta[index]:
                        check_replayed(record, index, t)
                    record.replay_packs = index + 1
                    return pack_below(t)

            else:

                def pack(t: torch.Tensor) -> Any:
                    index = record.replay_packs
                    if index < forward:  # more than forward: torch's own error says so
                        want = meta[index]
                        if (
                            t.shape != want[0]
                            or t.dtype != want[1]
                            or t.device != want[2]
                        ):
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


def _stand_in(record: CheckpointRecord, index: int, meta: tuple[Any, ...]) -> Any:
    if len(meta) == 4:  # METADATA_MODE_PLAIN
        shape, dtype, device, cls = meta
        if cls in _PLAIN_TYPES:
            return torch.zeros(shape, dtype=dtype, device=device)
        if record.saved_specs is not None:
            return _stand_in(record, index, record.saved_specs[index])
        raise RematError(
            f"remat_dist: cannot complete the failed replay of checkpoint "
            f"{record.name!r}: its forward saved a {cls.__name__} (saved tensor "
            f"#{index}) where its earlier forwards saved only plain tensors, so no "
            "stand-in can be built for it. This rank raises the replay's error "
            "instead of completing the backward with its peers (they fail at the "
            "bound). Fix: make the checkpoint save the same kinds of tensors on "
            "every call."
        )
    shape, dtype, device, stride, spec = meta[:5]
    if spec is not None:
        return make_stand_in(spec)
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()


def replace_mismatched(record: CheckpointRecord, target: tuple[Any, Any]) -> None:
    """Put a stand-in of the forward's metadata in place of every tensor a replay
    recomputed with another shape, dtype or device (its error was absorbed:
    backward goes on, and must not fail on those shapes)."""
    frame, gid = target
    data = frame.recomputed[gid].data
    meta = record.saved_meta
    with torch.no_grad():
        for index, handle, t in replayed_tensors(record, target):
            want = meta[index]
            if t.shape != want[0] or t.dtype != want[1] or t.device != want[2]:
                data[weakref.ref(handle)] = _stand_in(record, index, want)


def complete_with_stand_ins(record: CheckpointRecord) -> None:
    """Hand torch's recompute hook a stand-in for every saved tensor this replay did
    not recompute (runs inside the recompute context, after the replay raised)."""
    hooks = _top_hooks(False)
    if hooks is None:
        return
    with torch.no_grad():
        try:
            for meta in record.saved_meta[record.replay_packs :]:
                hooks[0](_stand_in(record, record.replay_packs, meta))
                record.replay_packs += 1
        except StopRecomputationError:
            pass
