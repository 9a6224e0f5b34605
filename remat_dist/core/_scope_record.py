"""The record behind a ``gradient_checkpoint_scope``: what it ran, how to rerun it.

How a scope keeps its tensors out of autograd's saved tensors:

* While the scope runs, a ``TorchDispatchMode`` (in :mod:`remat_dist.core._scope`)
  hands every ATen call to :meth:`ScopeRecord.record_op`. The record keeps the
  operator, its arguments with tensors replaced by references, the RNG state before
  a random draw and the autocast state. It never holds a tensor the scope created:
  those are known by *slot* (one per output object, tagged through a weak
  reference) and *base* (one per storage the scope allocated). Tensors read from
  outside are held: replay needs them.
* A saved-tensor pack hook, pushed for the scope's extent, turns any saved tensor
  whose storage is a base of the record into a :class:`_Handle` instead of keeping
  it; everything else goes to the hook that was active before (or is kept as
  usual).
* At scope exit the scope's still-referenced outputs become :class:`ScopeOutput`
  (same tensor, a ``__torch_function__`` subclass). An operator outside the scope
  that consumes one pushes the pack hook for that call only and pops it after, so
  later uses are protected too while no hook stays installed, and code that never
  touches a scope output pays nothing. Exceptions, where the output is saved as
  usual because something else holds it anyway: inside another scope (it is that
  scope's input) and under ``torch.utils.checkpoint`` (its input, and its forward
  and recompute must save the same tensors).
* The first unpack of a handle in a backward pass replays the recorded operators
  that tensor depends on, in recorded order, under the recorded RNG and autocast
  state; other replayed tensors that saved handles still need are kept for the rest
  of that backward pass only (dropped when their last handle is unpacked or when
  the pass ends).
* A record *closes* (drops everything it holds and turns its outputs back into
  plain tensors) when nothing can need it any more: no handle is alive and either
  no output is alive or a backward pass has already consumed its handles.

The parts: :mod:`~remat_dist.core._scope_tags` (tags and small types),
:mod:`~remat_dist.core._scope_replay` (handles and replay),
:mod:`~remat_dist.core._scope_hooks` (the pack/unpack pair),
:mod:`~remat_dist.core._scope_output` (outputs after the scope) and this module
(the record itself: what the scope ran, and when it closes).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from remat_dist._torch import _tensor
from remat_dist.core import _scope_ops, _scope_output, _scope_replay
from remat_dist.core._scope_hooks import _top_hooks, is_our_hook
from remat_dist.core._scope_output import ScopeOutput
from remat_dist.core._scope_replay import _Handle
from remat_dist.core._scope_tags import (
    _TAGS,
    _Base,
    _ExtRef,
    _has_tensor,
    _iter_ext,
    _Op,
    _SeqRef,
    _SlotRef,
    _storage_key,
    _version,
)

__all__ = ["ScopeOutput", "ScopeRecord", "live_scope_records"]


_LIVE: weakref.WeakSet[ScopeRecord] = weakref.WeakSet()


def live_scope_records() -> list[ScopeRecord]:
    """The records that can still replay (open), in no particular order.

    For memory reports: ``sum(r.kept_bytes() for r in live_scope_records())`` is what
    the scopes keep alive for replay.
    """
    return [r for r in list(_LIVE) if not r.closed]


_INFO = _scope_ops.INFO
_any_autocast = _tensor.any_autocast_enabled


class ScopeRecord:
    """Everything one outermost ``gradient_checkpoint_scope`` keeps for replay.

    Nested scopes share their outermost scope's record. Read it through
    :meth:`kept_bytes` and :meth:`stats`; the rest is internal.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.ops: list[_Op] = []
        self.slot_base: list[int] = []
        self.slot_op: list[int] = []
        self.bases: list[_Base] = []
        self.base_by_key: dict[int, int] = {}
        self._storage_weak: list[int] = []
        self._tags: list[tuple[int, tuple[Any, ScopeRecord, int]]] = []
        self._swapped: list[tuple[int, tuple[Any, ScopeRecord, int]]] = []
        self._ext_snapshots: dict[tuple[int, int], torch.Tensor] = {}
        self._cache: dict[int, dict[int, list[Any]]] = {}
        self.ext_alias_outs: set[int] | None = None
        """ids of the last op's outputs that alias an outside tensor: the only
        delegated saves that can be an op's own output (see PackHooks.pack)."""
        self.rng_bytes = 0
        self.replays = 0
        self.alive_swapped = 0
        self.total_handles = 0
        self.unpacked_any = False
        self.exited = False
        self.closed = False
        self.mixed = False
        """Some op in the scope ran under another (non-remat_dist) saved-tensor hook
        pushed inside the scope, e.g. ``torch.utils.checkpoint``'s: that hook saw
        scope tensors, so later ops under such a hook leave them to it as well
        (what a checkpoint saves on forward and on its recompute must agree)."""
        _LIVE.add(self)

    # --- introspection -----------------------------------------------------------

    def kept_bytes(self) -> int:
        """Bytes this record keeps alive for replay that nothing else needs: RNG
        snapshots, copies of outside tensors the scope wrote in place, and the
        non-leaf outside tensors it read (activations; each storage once). Leaf
        inputs such as parameters are alive anyway and are reported apart in
        :meth:`stats`. Zero once closed. Never includes a tensor the scope
        produced: those are not kept."""
        s = self.stats()
        return s["state_bytes"] + s["input_bytes"]

    def stats(self) -> dict[str, Any]:
        """A JSON-friendly breakdown of what the record holds.

        Keys: ``ops`` (recorded operators), ``bases`` (storages the scope
        allocated), ``inputs`` / ``input_bytes`` (non-leaf outside tensors read, by
        unique storage), ``leaf_inputs`` / ``leaf_input_bytes`` (leaf outside tensors
        and views of them, e.g. parameters), ``rng_state_bytes``, ``snapshot_bytes``
        (copies of outside tensors the scope wrote in place), ``state_bytes`` (their
        sum), ``cached_bytes`` (replayed tensors held for a backward pass running
        now), ``handles`` (saved-tensor handles alive), ``replays`` (replays run so
        far), ``open``.
        """
        with self.lock:
            sizes: dict[int, int] = {}
            leafish: dict[int, bool] = {}
            for op in self.ops:
                for ref in _iter_ext(op.args, op.kwargs):
                    t = ref.tensor
                    key = _storage_key(t)
                    if key is None:
                        continue
                    with _tensor.DisableTorchFunctionSubclass():
                        base = t._base
                        leaf = t.is_leaf or (base is not None and base.is_leaf)
                        sizes[key] = t.untyped_storage().nbytes()
                    leafish[key] = leafish.get(key, False) or leaf
            inputs = {k: n for k, n in sizes.items() if not leafish[k]}
            leaves = {k: n for k, n in sizes.items() if leafish[k]}
            snap = sum(
                t.untyped_storage().nbytes() for t in self._ext_snapshots.values()
            )
            cached = 0
            for cache in self._cache.values():
                for entry in cache.values():
                    cached += entry[0].untyped_storage().nbytes()
            return {
                "ops": len(self.ops),
                "bases": len(self.bases),
                "inputs": len(inputs),
                "input_bytes": sum(inputs.values()),
                "leaf_inputs": len(leaves),
                "leaf_input_bytes": sum(leaves.values()),
                "rng_state_bytes": self.rng_bytes,
                "snapshot_bytes": snap,
                "state_bytes": self.rng_bytes + snap,
                "cached_bytes": cached,
                "handles": self.total_handles,
                "replays": self.replays,
                "open": not self.closed,
            }

    # --- recording (runs in the scope's TorchDispatchMode) -----------------------

    def record_op(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run ``func`` and record it (called by the scope's dispatch mode)."""
        if not self.mixed:
            top = _top_hooks(True)
            if top is not None and not is_our_hook(top):
                self.mixed = True
        info = _INFO.get(func)
        if info is None:
            info = _scope_ops.op_info(func)
        deps: list[int] = []
        reads: list[int] = []
        writes: list[int] = []
        ext: list[torch.Tensor] = []
        wpos = info.write_pos
        eargs: Any = args
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                ref = self._ref(a, i in wpos, deps, reads, writes, ext)
            elif (type(a) is list or type(a) is tuple) and _has_tensor(a):
                ref = self._seq_ref(a, i in wpos, deps, reads, writes, ext)
            else:
                continue
            if eargs is args:
                eargs = list(args)
            eargs[i] = ref
        ekwargs = kwargs
        if kwargs:
            wkw = info.write_kw
            for k, v in kwargs.items():
                if isinstance(v, torch.Tensor):
                    ref = self._ref(v, k in wkw, deps, reads, writes, ext)
                elif (type(v) is list or type(v) is tuple) and _has_tensor(v):
                    ref = self._seq_ref(v, k in wkw, deps, reads, writes, ext)
                else:
                    continue
                if ekwargs is kwargs:
                    ekwargs = dict(kwargs)
                ekwargs[k] = ref
        rng = None
        if info.random:
            gen = _scope_ops.generator_for(args, kwargs)
            if gen is not None:
                rng = (gen, gen.get_state())
        autocast = _scope_ops.autocast_state() if _any_autocast() else None

        out = func(*args, **kwargs)

        op_index = len(self.ops)
        seq = type(out) is tuple or type(out) is list
        outs: list[tuple[int, int]] = []
        ext_keys: set[int | None] | None = None
        ext_alias: set[int] | None = None
        for k, o in enumerate(out if seq else (out,)):
            if not isinstance(o, torch.Tensor):
                continue
            entry = _TAGS.get(id(o))
            if entry is not None and entry[1] is self and entry[0]() is o:
                continue  # an in-place op returned its (scope) argument
            try:
                storage = o.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue  # no storage (sparse, nested): kept as usual
            key = storage._cdata
            base = self.base_by_key.get(key)
            slot = len(self.slot_base)
            if base is None:
                if info.may_alias and ext:
                    if ext_keys is None:
                        ext_keys = {_storage_key(t) for t in ext}
                    if key in ext_keys:
                        # A view or in-place result of an outside tensor.
                        if ext_alias is None:
                            ext_alias = set()
                        ext_alias.add(id(o))
                        continue
                base = len(self.bases)
                self.bases.append(_Base(slot, op_index))
                self.base_by_key[key] = base
                # A weak reference keeps the StorageImpl's address from being
                # reused for another storage while it is a key of base_by_key.
                self._storage_weak.append(_tensor.storage_weak_ref(storage))
            self.slot_base.append(base)
            self.slot_op.append(op_index)
            entry = (weakref.ref(o), self, slot)
            _TAGS[id(o)] = entry
            self._tags.append((id(o), entry))
            outs.append((k, slot))
        self.ext_alias_outs = ext_alias
        for base in writes:
            b = self.bases[base]
            b.last_writer = op_index
            b.writes += 1
        if outs or writes:
            if rng is not None:
                self.rng_bytes += rng[1].numel() * rng[1].element_size()
            self.ops.append(
                _Op(
                    func,
                    tuple(eargs),
                    ekwargs,
                    tuple(outs),
                    seq,
                    deps,
                    reads,
                    rng,
                    autocast,
                )
            )
        return out

    def _ref(
        self,
        t: torch.Tensor,
        mutated: bool,
        deps: list[int],
        reads: list[int],
        writes: list[int],
        ext: list[torch.Tensor],
    ) -> Any:
        entry = _TAGS.get(id(t))
        if entry is not None and entry[1] is self and entry[0]() is t:
            slot = entry[2]
            base = self.slot_base[slot]
            deps.append(self.slot_op[slot])
            deps.append(self.bases[base].last_writer)
            reads.append(slot)
            if mutated:
                writes.append(base)
            return _SlotRef(slot)
        version = _version(t)
        ext.append(t)
        if mutated and version is not None:
            # Replay must not write the live tensor: it writes a copy of the value
            # this op saw.
            key = (id(t), version)
            if key not in self._ext_snapshots:
                self._ext_snapshots[key] = t.detach().clone()
        return _ExtRef(t, version, mutated)

    def _seq_ref(self, seq, mutated, deps, reads, writes, ext) -> _SeqRef:
        return _SeqRef(
            type(seq),
            [
                self._ref(x, mutated, deps, reads, writes, ext)
                if isinstance(x, torch.Tensor)
                else x
                for x in seq
            ],
        )

    # --- saved-tensor handles ----------------------------------------------------

    def handle_in_scope(self, base: int, t: torch.Tensor) -> _Handle:
        with self.lock:
            b = self.bases[base]
            b.handles += 1
            self.total_handles += 1
            return _Handle(self, base, t, b.writes)

    def handle_after_exit(self, base: int, t: torch.Tensor) -> _Handle | None:
        """A handle for a scope output saved by an op after the scope, or None
        (closed record, or the tensor was modified in place after the scope)."""
        with self.lock:
            if self.closed:
                return None
            b = self.bases[base]
            if b.exit_version is None or _version(t) != b.exit_version:
                return None
            b.handles += 1
            self.total_handles += 1
            return _Handle(self, base, t, b.writes)

    def _release(self, base: int) -> None:
        with self.lock:
            self.bases[base].handles -= 1
            self.total_handles -= 1
            if (
                self.total_handles == 0
                and self.exited
                and (self.unpacked_any or self.alive_swapped == 0)
            ):
                self._close()

    def _swapped_died(self) -> None:
        with self.lock:
            self.alive_swapped -= 1
            if self.alive_swapped == 0 and self.total_handles == 0 and self.exited:
                self._close()

    # --- scope exit and close ----------------------------------------------------

    def finish(self) -> None:
        """Called once when the outermost scope exits: forget the storages, turn
        the outputs still referenced into :class:`ScopeOutput`."""
        with self.lock:
            self.exited = True
            for ref in self._storage_weak:
                _tensor.free_storage_weak_ref(ref)
            self._storage_weak = []
            self.base_by_key = {}
            self.ext_alias_outs = None
            _scope_output.swap_outputs(self)
            if self.total_handles == 0 and (
                self.alive_swapped == 0 or not torch.is_grad_enabled()
            ):
                self._close()

    def adopt(self, o: torch.Tensor, base: int) -> None:
        """Make ``o`` (a view of a scope output made after the scope) a scope
        output too, so that what later ops save of it is a handle as well."""
        with self.lock:
            if not self.closed:
                _scope_output.swap(self, o, self.bases[base].root_slot)

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.ops = []
        self._ext_snapshots = {}
        self._cache = {}
        self.rng_bytes = 0
        _scope_output.release_outputs(self)
        _LIVE.discard(self)

    # --- replay ------------------------------------------------------------------

    def unpack(self, h: _Handle) -> torch.Tensor:
        """The tensor ``h`` stands for; see
        :func:`remat_dist.core._scope_replay.unpack`."""
        return _scope_replay.unpack(self, h)
