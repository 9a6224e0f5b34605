"""Value fingerprints: did a replay compute the values its forward computed?

``_replay_check`` compares the shape, dtype and device of every tensor a replay
saves with the forward's. That misses a replay that computes *other values* of the
same shape: a nondeterministic top-k or a tie broken another way on a GPU, a
generator the state hooks do not cover, a buffer changed between forward and
backward. The gradients are then wrong without a word.

With ``determinism_check="values"`` (per checkpoint, or process-wide with
``REMAT_DIST_DETERMINISM_CHECK=values`` in the environment) every tensor torch's
checkpoint saves in forward gets a fingerprint (:func:`fingerprint`: a 1-element
int64 tensor computed on the tensor's device, no copy of the tensor kept), and
every tensor the replay saves in its place is fingerprinted the same way. At the
replay's end (torch's early stop included) the two are compared in one go
(:func:`replay_done`): one device synchronisation per replay, none per tensor.

A difference is a :class:`~remat_dist.errors.ReplayValueMismatchError` naming the
checkpoint, the saved tensor (its position, region, the op that made it), and
the causes with their fixes. The core offers it first to the observers
(``on_replay_values(record, text) -> bool``, the layer above adds the rank and
reports it among the replay group's ranks); when none takes it, it is raised at the end
of the backward pass (:func:`raise_at_backward_end`), so the backward's other
work and collectives complete first, or at once outside a backward.

Leaves that require grad (parameters, inputs that require grad) are not
fingerprinted: a replay does not produce them, it reuses them.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from remat_dist._errors import ReplayValueMismatchError
from remat_dist._torch import _autograd, _c10d
from remat_dist.core import _record

if TYPE_CHECKING:
    from remat_dist.core._options import CheckpointOptions
    from remat_dist.core._record import CheckpointRecord

__all__ = [
    "ENV",
    "fingerprint",
    "fingerprints_differ",
    "raise_at_backward_end",
    "replay_done",
    "values_check_enabled",
    "wrap_pack",
]

ENV = "REMAT_DIST_DETERMINISM_CHECK"
"""``values`` here turns the value check on for every checkpoint of the process;
any other value leaves each checkpoint's own ``determinism_check``."""

_queue_callback = _autograd.queue_callback
_graph_task_id = _autograd.current_graph_task_id

VALUE_CAUSES = (
    "The replay computed other values than the forward from the same inputs. Likely "
    "causes, with the fix:\n"
    "  - a nondeterministic op (a top-k or sort with ties, index_add / scatter_add "
    "or another atomic on a GPU): make it deterministic "
    "(torch.use_deterministic_algorithms(True), a stable sort, a tie-breaking "
    "epsilon), or keep its output with remat_dist.region(fn, name, "
    "recompute=False) so the replay does not recompute it;\n"
    "  - random numbers from a generator the state hooks do not restore: add it "
    "with recompute_state_hooks=(..., remat_dist.distributed.GeneratorStateHook(gen));\n"
    "  - state read by the block that changed between forward and backward (a "
    "buffer updated in place, a Python flag): restore it with a "
    "RecomputeStateHook or guard the change with remat_dist.is_recomputing()."
)


def values_check_enabled(options: CheckpointOptions) -> bool:
    """Whether a checkpoint with ``options`` compares values on replay:
    ``determinism_check="values"``, or ``REMAT_DIST_DETERMINISM_CHECK=values``."""
    if options.determinism_check == "values":
        return True
    if _ENV_BYTES is not None:  # one dict lookup: asked on every checkpoint
        value = _ENV_BYTES.get(_ENV_KEY)
        if value is None:
            return False
    return os.environ.get(ENV, "").strip().lower() == "values"


# os.environ's own mapping of encoded names (POSIX); elsewhere the plain lookup
_ENV_BYTES: dict[Any, Any] | None = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV) if _ENV_BYTES is not None else None  # type: ignore[attr-defined]


# ------------------------------------------------------------------ fingerprints


_inflight, _wait_tensor = _c10d.functional_wait()
"""How many outputs of functional collectives (``funcol``, DTensor) nobody has
waited for yet, and the op that waits for one: the bytes of such an output are
read only after its collective completed (a no-op for any other tensor)."""


def fingerprint(t: Any) -> torch.Tensor | None:
    """A one-element int64 tensor (one per inner tensor of a subclass), on ``t``'s
    device, that changes when ``t``'s bytes change (None for what has no bytes to read: meta and fake tensors, sparse
    layouts, empty tensors).

    The bytes are read as integers (so the result is exact and the same on every
    device and in every reduction order, wrapping around): per row (the last
    dimension; a 1-D tensor's elements are rows), the sum; then the sum of the row
    sums' prefix sums, which weighs row ``i`` of ``n`` by ``n - i``, so a changed
    row changes it and so do permuted rows (tokens routed to other slots). Tensor subclasses (DTensor) are
    read through their inner tensors. The output of a functional collective
    still in flight is waited for first (reading it earlier would read whatever
    the buffer held)."""
    parts: list[torch.Tensor] = []
    _collect(t, parts)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _collect(t: Any, out: list[torch.Tensor]) -> None:
    if not isinstance(t, torch.Tensor):
        return
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is not None:
            for name in flatten()[0]:
                _collect(getattr(t, name), out)
        return  # another subclass (fake tensors): nothing to read
    if t.layout is not torch.strided or t.is_meta or t.numel() == 0:
        return
    x = t.detach()
    if _inflight is not None and _inflight():
        x = _wait_tensor(x)  # a functional collective's output may be in flight
    if not x.is_contiguous():
        inner = _dense_inner(x)
        if inner is None:  # gaps or overlaps: read a copy
            x = x.contiguous()
        else:  # a permuted layout (a transposed view): read its memory in order
            x = x.as_strided((x.numel() // inner, inner), (inner, 1))
    size = x.element_size()
    rows = x.numel() // x.shape[-1] if x.dim() >= 2 else x.numel()
    row_bytes = x.numel() * size // rows
    start = x.storage_offset() * size
    dtype = next(d for w, d in _WORDS if row_bytes % w == 0 and start % w == 0)
    words = x.view(rows, row_bytes // size)
    if x.dtype is not dtype:
        words = words.view(dtype)  # the same bytes, read as integers
    if words.shape[1] == 1:
        sums = words.view(rows)
    else:
        sums = words.sum(1) if dtype is torch.int64 else words.sum(1, dtype=torch.int64)
    # the prefix sums' sum weighs row i by rows - i: a changed or moved row shows
    out.append(sums.cumsum(0, dtype=torch.int64).sum(0, keepdim=True))


def _dense_inner(x: torch.Tensor) -> int | None:
    """The size of the innermost dimension in memory when ``x`` covers a dense
    block without gaps or overlaps in some order of its dimensions, else None."""
    dims = sorted((st, n) for n, st in zip(x.shape, x.stride(), strict=True) if n != 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return None
        expected *= n
    return dims[0][1] if dims else 1


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def fingerprints_differ(
    forward: list[torch.Tensor], replay: list[torch.Tensor]
) -> list[int]:
    """The positions where two equally long lists of fingerprints differ: one
    comparison (one synchronisation) per device when none does."""
    differ: list[int] = []
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, (a, b) in enumerate(zip(forward, replay, strict=True)):
        if a.shape != b.shape or a.device != b.device:
            differ.append(i)
        else:
            groups.setdefault((a.device, a.shape), []).append(i)
    for positions in groups.values():
        a = torch.stack([forward[i] for i in positions])
        b = torch.stack([replay[i] for i in positions])
        if torch.equal(a, b):
            continue
        rows = (a != b).flatten(1).any(1).nonzero().flatten().tolist()
        differ.extend(positions[j] for j in rows)
    return sorted(differ)


# ------------------------------------------------------- saved tensors of a record


@dataclass
class _Saved:
    """One checkpoint's fingerprints: the forward's per saved tensor (None where
    not taken), and the current replay's ``(index, fingerprint, op, region)``."""

    forward: list[torch.Tensor | None] = field(default_factory=list)
    replay: list[tuple[int, torch.Tensor, str | None, str | None]] = field(
        default_factory=list
    )


_saved: weakref.WeakKeyDictionary[CheckpointRecord, _Saved] = (
    weakref.WeakKeyDictionary()
)


def _wanted(t: torch.Tensor) -> bool:
    return not (t.requires_grad and t.grad_fn is None)


def wrap_pack(
    record: CheckpointRecord, pack: Callable[[torch.Tensor], Any]
) -> Callable[[torch.Tensor], Any]:
    """The tracking pack hook of ``record``'s forward or replay, fingerprinting each
    saved tensor first when the value check is on (``pack`` itself otherwise)."""
    if not record.values_check or torch.compiler.is_compiling():
        return pack
    if not record.replaying:
        saved = _saved[record] = _Saved()
        forward = saved.forward

        def fingerprinting(t: torch.Tensor) -> Any:
            forward.append(fingerprint(t) if _wanted(t) else None)
            return pack(t)

        return fingerprinting
    saved = _saved.get(record)
    if saved is None:  # the check was turned on after this forward
        return pack
    saved.replay = []
    taken, replay = saved.forward, saved.replay

    def checking(t: torch.Tensor) -> Any:
        index = record.replay_packs
        if index < len(taken) and taken[index] is not None:
            got = fingerprint(t)
            if got is not None:
                node = t.grad_fn
                op = None if node is None else type(node).__name__
                running = record.current_region()
                region = None if running is None else running.name
                replay.append((index, got, op, region))
        return pack(t)  # torch's early stop raises here, after the last one

    return checking


def replay_done(record: CheckpointRecord) -> BaseException | None:
    """At the end of ``record``'s replay (run to its end or stopped early): compare
    the saved tensors' fingerprints. A difference is offered to the observers,
    else raised at the end of the backward pass; returned when it must be raised
    at once (no backward is running)."""
    saved = _saved.get(record)
    if saved is None or not saved.replay:
        return None
    replay, saved.replay = saved.replay, []
    forward = [saved.forward[i] for i, *_ in replay]
    differ = fingerprints_differ(forward, [fp for _, fp, *_ in replay])  # type: ignore[misc]
    if not differ:
        return None
    index, got, op, region = replay[differ[0]]
    want = forward[differ[0]]
    inside = f" in region {region!r}" if region else ""
    meta = record.saved_meta[index] if index < len(record.saved_meta) else None
    what = [f"shape {tuple(meta[0])}", f"dtype {meta[1]}"] if meta else []
    what.append(f"made by {op}" if op else "made outside autograd")
    text = (
        f"checkpoint {record.name!r}: the replay computed other values than the "
        f"forward: saved tensor #{index}{inside} ({', '.join(what)}) "
        f"differs (fingerprint {_show(want)} on forward, {_show(got)} on replay); "
        f"{len(differ)} of the {len(replay)} saved tensor(s) compared differ. Its "
        "shape and dtype match, so nothing failed, but the gradients of this "
        f"backward are wrong: do not step the optimizer.\n{VALUE_CAUSES}"
    )
    for obs in tuple(_record._SEAMS.observers):
        method = getattr(obs, "on_replay_values", None)
        if method is not None and method(record, text):
            return None
    return raise_at_backward_end(ReplayValueMismatchError(f"remat_dist: {text}"))


def _show(fp: torch.Tensor | None) -> str:
    return "-" if fp is None else "/".join(str(int(v)) for v in fp.tolist())


# ------------------------------------------------------------ backward's end

_pending: dict[int, list[BaseException]] = {}


def raise_at_backward_end(error: BaseException) -> BaseException | None:
    """Raise ``error`` when the running backward pass ends (after its other work,
    before ``backward()`` returns), the first of several; outside a backward,
    return it for the caller to raise at once."""
    task = _graph_task_id()
    if task == -1:
        return error
    errors = _pending.get(task)
    if errors is None:
        errors = _pending[task] = []
        _queue_callback(lambda: _raise_pending(task))
    errors.append(error)
    return None


def _raise_pending(task: int) -> None:
    errors = _pending.pop(task, [])
    if errors:
        first = errors[0]
        if len(errors) > 1 and hasattr(first, "add_note"):
            first.add_note(f"remat_dist: and {len(errors) - 1} more in this backward")
        raise first
