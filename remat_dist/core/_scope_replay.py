"""Replay: how a saved scope tensor is got back in backward.

:class:`_Handle` is what autograd keeps instead of a tensor the scope produced.
Its first unpack in a backward pass (:func:`unpack`) reruns the recorded
operators the tensor depends on (:func:`_replay`) under the recorded RNG and
autocast state; replayed tensors that other live handles still need are cached
for the rest of that backward pass only.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from remat_dist._errors import RematError
from remat_dist._torch import _autograd, _tensor
from remat_dist.core import _scope_ops
from remat_dist.core._scope_tags import (
    FLAGS,
    _ExtRef,
    _Op,
    _SeqRef,
    _SlotRef,
    _version,
)

if TYPE_CHECKING:
    from remat_dist.core._scope_record import ScopeRecord

_UNSET = object()


class _Handle:
    """What autograd keeps instead of a scope tensor: how to get it back."""

    __slots__ = (
        "record",
        "base",
        "size",
        "stride",
        "offset",
        "dtype",
        "flags",
        "writes",
    )

    def __init__(self, record: ScopeRecord, base: int, t: torch.Tensor, writes: int):
        self.record = record
        self.base = base
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.dtype = t.dtype
        self.flags = (t.is_conj(), t.is_neg())
        self.writes = writes

    def __del__(self) -> None:
        try:
            self.record._release(self.base)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def rebuild(self, root: torch.Tensor) -> torch.Tensor:
        """The saved tensor: ``root`` itself, or the view of its storage it was."""
        conj, neg = self.flags
        if (
            self.dtype == root.dtype
            and self.offset == root.storage_offset()
            and self.size == root.size()
            and self.stride == root.stride()
            and not conj
            and not neg
        ):
            return root
        FLAGS.replaying += 1
        try:
            with torch.no_grad():
                t = torch.empty((0,), dtype=self.dtype, device=root.device)
                t.set_(root.untyped_storage(), self.offset, self.size, self.stride)
                if conj:
                    t = t.conj()
                if neg:
                    t = _tensor.neg_view(t)
        finally:
            FLAGS.replaying -= 1
        return t


def unpack(record: ScopeRecord, h: _Handle) -> torch.Tensor:
    """The tensor ``h`` stands for: from this backward pass's cache, else
    replayed (and what the pass still needs of the replay cached)."""
    with record.lock:
        if record.closed:
            raise RematError(
                "gradient_checkpoint_scope: a saved tensor's record was already "
                "released; this is a remat_dist bug, please report it."
            )
        base = record.bases[h.base]
        if h.writes != base.writes:
            raise RematError(
                "gradient_checkpoint_scope: one of the tensors needed for "
                "gradient computation was modified by an in-place operation "
                "inside the scope after an operation saved it (plain autograd "
                "reports this too). Fix: clone it before modifying it."
            )
        record.unpacked_any = True
        gid = _autograd.current_graph_task_id()
        root = None
        cache = record._cache.get(gid) if gid >= 0 else None
        if cache is not None:
            entry = cache.get(h.base)
            if entry is not None:
                root = entry[0]
                entry[1] -= 1
                if entry[1] <= 0:
                    del cache[h.base]
        if root is None:
            results = _replay(record, h.base)
            root = results.pop(h.base)
            if gid >= 0:
                if cache is None:
                    cache = record._cache[gid] = {}
                    _autograd.queue_callback(
                        functools.partial(_drop_cache, record, gid)
                    )
                left = base.handles - 1
                if left > 0:
                    cache[h.base] = [root, left]
                for b, t in results.items():
                    n = record.bases[b].handles
                    if n > 0 and b not in cache:
                        cache[b] = [t, n]
            del results
        return h.rebuild(root)


def _drop_cache(record: ScopeRecord, gid: int) -> None:
    with record.lock:
        record._cache.pop(gid, None)


def _replay(record: ScopeRecord, target: int) -> dict[int, torch.Tensor]:
    """Rerun what the final value of base ``target`` depends on.

    Returns the replayed root tensor of ``target`` and of every other base that
    reached its final value in this replay and still has saved handles.
    Intermediate results are freed as soon as the replay is past their last
    use.
    """
    record.replays += 1
    ops = record.ops
    base = record.bases[target]
    need: set[int] = set()
    stack = [record.slot_op[base.root_slot], base.last_writer]
    while stack:
        j = stack.pop()
        if j not in need:
            need.add(j)
            stack.extend(ops[j].deps)
    order = sorted(need)

    keep: dict[int, int] = {}
    last_use: dict[int, int] = {}
    for j in order:
        op = ops[j]
        for s in op.reads:
            last_use[s] = j
        for _, s in op.outs:
            b = record.slot_base[s]
            bb = record.bases[b]
            if (
                bb.root_slot == s
                and bb.last_writer in need
                and (b == target or bb.handles > 0)
            ):
                keep[s] = b
    frees: dict[int, list[int]] = {}
    for j in order:
        for _, s in ops[j].outs:
            if s not in keep:
                frees.setdefault(last_use.get(s, j), []).append(s)

    vals: dict[int, torch.Tensor] = {}
    gens: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
    saved_autocast = _scope_ops.full_autocast_state()
    current_autocast: Any = _UNSET
    FLAGS.replaying += 1
    try:
        with torch.no_grad(), _tensor.DisableTorchFunction():
            torch.set_autocast_cache_enabled(False)
            for j in order:
                op = ops[j]
                if op.autocast is not current_autocast:
                    _scope_ops.apply_autocast(op.autocast)
                    current_autocast = op.autocast
                if op.rng is not None:
                    gen, state = op.rng
                    if id(gen) not in gens:
                        gens[id(gen)] = (gen, gen.get_state())
                    gen.set_state(state)
                args = [_decode(record, a, vals, op) for a in op.args]
                kwargs = (
                    {k: _decode(record, v, vals, op) for k, v in op.kwargs.items()}
                    if op.kwargs
                    else {}
                )
                out = op.func(*args, **kwargs)
                if op.outs:
                    flat = out if op.seq else (out,)
                    for k, s in op.outs:
                        vals[s] = flat[k]
                    del flat
                del args, kwargs, out
                for s in frees.get(j, ()):
                    vals.pop(s, None)
    finally:
        for gen, state in gens.values():
            gen.set_state(state)
        _scope_ops.restore_full_autocast(saved_autocast)
        FLAGS.replaying -= 1
    return {b: vals[s] for s, b in keep.items()}


def _decode(
    record: ScopeRecord, a: Any, vals: dict[int, torch.Tensor], op: _Op
) -> Any:
    tp = type(a)
    if tp is _SlotRef:
        return vals[a.slot]
    if tp is _ExtRef:
        t = a.tensor
        if a.version is not None and _version(t) != a.version:
            snap = record._ext_snapshots.get((id(t), a.version))
            if snap is None:
                raise RematError(
                    f"gradient_checkpoint_scope: replaying {op.func} needs a "
                    f"tensor of shape {tuple(t.shape)} read from outside the "
                    f"scope at version {a.version}, but it was modified in "
                    f"place since (now version {_version(t)}). Fix: modify it "
                    "only after backward, or pass a clone into the scope."
                )
            t = snap
        return t.clone() if a.mutated else t
    if tp is _SeqRef:
        return a.kind(_decode(record, x, vals, op) for x in a.items)
    return a
