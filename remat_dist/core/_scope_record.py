"""The record behind a ``gradient_checkpoint_scope``: what it ran, how to rerun it.

How a scope keeps its tensors out of autograd's saved tensors:

* While the scope runs, a ``TorchDispatchMode`` (in :mod:`remat_dist.core.scope`)
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
"""

from __future__ import annotations

import functools
import threading
import weakref
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch

from remat_dist.core import _scope_ops
from remat_dist.errors import RematError

__all__ = ["ScopeOutput", "ScopeRecord", "live_scope_records"]


class _Flags(threading.local):
    bypass = 0
    """>0 while the scope's own hooks run: the mode must not record their ops."""
    replaying = 0
    """>0 while a record replays on this thread: no mode records the replay."""


FLAGS = _Flags()


class Active:
    """The innermost recording scope of a context (its record and nesting depth)."""

    __slots__ = ("record", "depth", "thread")

    def __init__(self, record: ScopeRecord, depth: int, thread: int) -> None:
        self.record = record
        self.depth = depth
        self.thread = thread


ACTIVE: ContextVar[Active | None] = ContextVar("remat_dist_scope", default=None)


def recording_record() -> ScopeRecord | None:
    """The record of the scope recording in this context and thread, if any."""
    active = ACTIVE.get()
    if active is None or active.thread != threading.get_ident():
        return None
    return active.record


_LIVE: weakref.WeakSet[ScopeRecord] = weakref.WeakSet()


def live_scope_records() -> list[ScopeRecord]:
    """The records that can still replay (open), in no particular order.

    For memory reports: ``sum(r.kept_bytes() for r in live_scope_records())`` is what
    the scopes keep alive for replay.
    """
    return [r for r in list(_LIVE) if not r.closed]


# --- tensor tags -----------------------------------------------------------------

# id(tensor) -> (weak reference, record, slot): which recorded output an object is.
# Entries are checked against the weak reference before use (ids are reused).
_TAGS: dict[int, tuple[Any, ScopeRecord, int]] = {}


class _SwapRef(weakref.ref):
    """Weak reference to a scope output after its scope; tells the record when
    the object dies (the record closes once no output and no handle is left)."""

    __slots__ = ("key", "record", "live")

    def __new__(cls, obj: torch.Tensor, record: ScopeRecord) -> _SwapRef:
        return super().__new__(cls, obj, _swap_died)

    def __init__(self, obj: torch.Tensor, record: ScopeRecord) -> None:
        super().__init__(obj, _swap_died)
        self.key = id(obj)
        self.record = record
        self.live = True


def _swap_died(ref: _SwapRef) -> None:
    entry = _TAGS.get(ref.key)
    if entry is not None and entry[0] is ref:
        del _TAGS[ref.key]
    if ref.live:
        ref.live = False
        ref.record._swapped_died()


def tag_of(t: torch.Tensor) -> tuple[Any, ScopeRecord, int] | None:
    entry = _TAGS.get(id(t))
    if entry is not None and entry[0]() is t:
        return entry
    return None


def _untag(key: int, entry: tuple[Any, ScopeRecord, int]) -> None:
    if _TAGS.get(key) is entry:
        del _TAGS[key]


def _version(t: torch.Tensor) -> int | None:
    try:
        if type(t) is torch.Tensor:
            return t._version
        with torch._C.DisableTorchFunctionSubclass():
            return t._version
    except RuntimeError:
        # Inference tensors have no version counter.
        return None


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        if type(t) is torch.Tensor:
            return t.untyped_storage()._cdata
        with torch._C.DisableTorchFunctionSubclass():
            return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


# --- references inside recorded arguments ---------------------------------------


class _SlotRef:
    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        self.slot = slot


class _ExtRef:
    """A tensor the scope read from outside, with its version at the read."""

    __slots__ = ("tensor", "version", "mutated")

    def __init__(self, tensor: torch.Tensor, version: int | None, mutated: bool):
        self.tensor = tensor
        self.version = version
        self.mutated = mutated


class _SeqRef:
    __slots__ = ("kind", "items")

    def __init__(self, kind: type, items: list[Any]) -> None:
        self.kind = kind
        self.items = items


class _Op(NamedTuple):
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outs: tuple[tuple[int, int], ...]
    """(index in the flat outputs, slot) of each output that got a slot."""
    seq: bool
    """The op returns a tuple or list."""
    deps: list[int]
    """Indices of ops that must run before this one (with repeats)."""
    reads: list[int]
    """Slots among the arguments."""
    rng: tuple[torch.Generator, torch.Tensor] | None
    """The generator the op draws from and its state before the op."""
    autocast: tuple[Any, ...] | None


class _Base:
    """One storage the scope allocated."""

    __slots__ = ("root_slot", "last_writer", "writes", "exit_version", "handles")

    def __init__(self, root_slot: int, op: int) -> None:
        self.root_slot = root_slot
        self.last_writer = op
        self.writes = 1
        self.exit_version: int | None = None
        self.handles = 0


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
                    t = torch._neg_view(t)
        finally:
            FLAGS.replaying -= 1
        return t


class _Delegated:
    __slots__ = ("unpack", "packed")

    def __init__(self, unpack: Any, packed: Any) -> None:
        self.unpack = unpack
        self.packed = packed


def _check_version(t: torch.Tensor, version: int | None) -> torch.Tensor:
    if version is not None and _version(t) != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified "
            f"by an inplace operation: [{t.type()} {list(t.shape)}] is at version "
            f"{_version(t)}; expected version {version} instead."
        )
    return t


_UNSET = object()
_INFO = _scope_ops.INFO
_any_autocast = torch._C._is_any_autocast_enabled


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
                    with torch._C.DisableTorchFunctionSubclass():
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
                self._storage_weak.append(storage._weak_ref())
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
                torch.UntypedStorage._free_weak_ref(ref)
            self._storage_weak = []
            self.base_by_key = {}
            self.ext_alias_outs = None
            tags, self._tags = self._tags, []
            for key, entry in tags:
                o = entry[0]()
                if o is None:
                    _untag(key, entry)
                    continue
                slot = entry[2]
                self.bases[self.slot_base[slot]].exit_version = _version(o)
                if type(o) is torch.Tensor and _TAGS.get(key) is entry:
                    self._swap(o, slot)
                else:
                    self._tags.append((key, entry))  # untagged at close
            del tags
            if self.total_handles == 0 and (
                self.alive_swapped == 0 or not torch.is_grad_enabled()
            ):
                self._close()

    def _swap(self, o: torch.Tensor, slot: int) -> None:
        entry = (_SwapRef(o, self), self, slot)
        _TAGS[id(o)] = entry
        self._swapped.append((id(o), entry))
        o.__class__ = ScopeOutput
        self.alive_swapped += 1

    def adopt(self, o: torch.Tensor, base: int) -> None:
        """Make ``o`` (a view of a scope output made after the scope) a scope
        output too, so that what later ops save of it is a handle as well."""
        with self.lock:
            if not self.closed:
                self._swap(o, self.bases[base].root_slot)

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.ops = []
        self._ext_snapshots = {}
        self._cache = {}
        self.rng_bytes = 0
        swapped, self._swapped = self._swapped, []
        tags, self._tags = self._tags, []
        self.alive_swapped = 0
        for key, entry in swapped:
            ref = entry[0]
            ref.live = False
            o = ref()
            if o is not None and type(o) is ScopeOutput:
                o.__class__ = torch.Tensor
            _untag(key, entry)
        for key, entry in tags:
            _untag(key, entry)
        _LIVE.discard(self)

    # --- replay ------------------------------------------------------------------

    def unpack(self, h: _Handle) -> torch.Tensor:
        with self.lock:
            if self.closed:
                raise RematError(
                    "gradient_checkpoint_scope: a saved tensor's record was already "
                    "released; this is a remat_dist bug, please report it."
                )
            base = self.bases[h.base]
            if h.writes != base.writes:
                raise RematError(
                    "gradient_checkpoint_scope: one of the tensors needed for "
                    "gradient computation was modified by an in-place operation "
                    "inside the scope after an operation saved it (plain autograd "
                    "reports this too). Fix: clone it before modifying it."
                )
            self.unpacked_any = True
            gid = torch._C._current_graph_task_id()
            root = None
            cache = self._cache.get(gid) if gid >= 0 else None
            if cache is not None:
                entry = cache.get(h.base)
                if entry is not None:
                    root = entry[0]
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del cache[h.base]
            if root is None:
                results = self._replay(h.base)
                root = results.pop(h.base)
                if gid >= 0:
                    if cache is None:
                        cache = self._cache[gid] = {}
                        torch.autograd.Variable._execution_engine.queue_callback(
                            functools.partial(self._drop_cache, gid)
                        )
                    left = base.handles - 1
                    if left > 0:
                        cache[h.base] = [root, left]
                    for b, t in results.items():
                        n = self.bases[b].handles
                        if n > 0 and b not in cache:
                            cache[b] = [t, n]
                del results
            return h.rebuild(root)

    def _drop_cache(self, gid: int) -> None:
        with self.lock:
            self._cache.pop(gid, None)

    def _replay(self, target: int) -> dict[int, torch.Tensor]:
        """Rerun what the final value of base ``target`` depends on.

        Returns the replayed root tensor of ``target`` and of every other base that
        reached its final value in this replay and still has saved handles.
        Intermediate results are freed as soon as the replay is past their last
        use.
        """
        self.replays += 1
        ops = self.ops
        base = self.bases[target]
        need: set[int] = set()
        stack = [self.slot_op[base.root_slot], base.last_writer]
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
                b = self.slot_base[s]
                bb = self.bases[b]
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
            with torch.no_grad(), torch._C.DisableTorchFunction():
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
                    args = [self._decode(a, vals, op) for a in op.args]
                    kwargs = (
                        {k: self._decode(v, vals, op) for k, v in op.kwargs.items()}
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

    def _decode(self, a: Any, vals: dict[int, torch.Tensor], op: _Op) -> Any:
        tp = type(a)
        if tp is _SlotRef:
            return vals[a.slot]
        if tp is _ExtRef:
            t = a.tensor
            if a.version is not None and _version(t) != a.version:
                snap = self._ext_snapshots.get((id(t), a.version))
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
            return a.kind(self._decode(x, vals, op) for x in a.items)
        return a


def _has_tensor(a: list[Any] | tuple[Any, ...]) -> bool:
    for x in a:
        if isinstance(x, torch.Tensor):
            return True
    return False


def _iter_ext(args: tuple[Any, ...], kwargs: dict[str, Any]):
    for a in (*args, *kwargs.values()):
        if type(a) is _ExtRef:
            yield a
        elif type(a) is _SeqRef:
            for x in a.items:
                if type(x) is _ExtRef:
                    yield x


# --- the pack/unpack pair --------------------------------------------------------


class PackHooks:
    """The saved-tensor hook pair of a scope (``record`` set) or of one call that
    consumes scope outputs after their scope (``local`` set: storage key ->
    (record, base)). Anything else goes to the hooks that were on top before."""

    __slots__ = ("record", "local", "outer")

    def __init__(
        self,
        record: ScopeRecord | None,
        local: dict[int, tuple[ScopeRecord, int]] | None,
        outer: tuple[Any, Any] | None,
    ) -> None:
        self.record = record
        self.local = local
        self.outer = outer

    def pack(self, t: torch.Tensor) -> Any:
        if type(t) is torch.Tensor:
            try:
                key = t.untyped_storage()._cdata
            except (RuntimeError, NotImplementedError):
                key = None
        else:
            key = _storage_key(t)
        rec = self.record
        if key is not None:
            if rec is not None:
                base = rec.base_by_key.get(key)
                if base is not None and not rec.exited:
                    return rec.handle_in_scope(base, t)
            else:
                hit = self.local.get(key)  # type: ignore[union-attr]
                if hit is not None:
                    h = hit[0].handle_after_exit(hit[1], t)
                    if h is not None:
                        return h
        outer = self.outer
        if outer is not None:
            if is_our_hook(outer):
                return outer[0](t)
            FLAGS.bypass += 1
            try:
                return _Delegated(outer[1], outer[0](t))
            finally:
                FLAGS.bypass -= 1
        # Kept as usual. Holding an op's own output here would be a reference
        # cycle through its grad_fn; inside a scope the record knows the last op's
        # outputs, so only those (outputs aliasing outside tensors) are detached.
        if key is not None and type(t) is torch.Tensor:
            if t.is_leaf:
                return (t, _version(t))  # a leaf is no op's output
            if rec is not None and recording_record() is rec:
                aliases = rec.ext_alias_outs
                if aliases is None or id(t) not in aliases:
                    return (t, _version(t))
        FLAGS.bypass += 1
        try:
            with torch._C.DisableTorchFunctionSubclass():
                return (t.detach(), _version(t))
        finally:
            FLAGS.bypass -= 1

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        tp = type(packed)
        if tp is tuple:
            # Autograd checks versions only of tensors it keeps itself.
            return _check_version(*packed)
        if tp is _Handle:
            return packed.record.unpack(packed)
        return packed.unpack(packed.packed)


def is_our_hook(top: tuple[Any, Any] | None) -> bool:
    return top is not None and type(getattr(top[0], "__self__", None)) is PackHooks


def _is_torch_checkpoint_hook(top: tuple[Any, Any]) -> bool:
    module = getattr(top[0], "__module__", None) or ""
    return module.startswith("torch.utils.checkpoint")


# --- scope outputs after the scope -----------------------------------------------

_DISABLED_TF = torch._C._disabled_torch_function_impl
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_hooks_enabled = torch._C._autograd._saved_tensors_hooks_is_enabled


def _metadata_functions() -> frozenset[Any]:
    """Tensor attribute getters and methods that neither save nor alias a tensor:
    a scope output answers them without the hook."""
    base = torch._C.TensorBase
    getters = [
        "shape",
        "dtype",
        "device",
        "layout",
        "requires_grad",
        "grad_fn",
        "is_leaf",
        "ndim",
        "is_cuda",
        "is_cpu",
        "is_sparse",
        "is_quantized",
        "is_meta",
        "is_nested",
        "_version",
        "names",
        "output_nr",
        "_base",
        "grad",
        "itemsize",
        "nbytes",
    ]
    methods = [
        "size",
        "stride",
        "dim",
        "numel",
        "storage_offset",
        "data_ptr",
        "untyped_storage",
        "is_contiguous",
        "element_size",
        "get_device",
        "is_floating_point",
        "is_complex",
        "is_conj",
        "is_neg",
        "__len__",
        "nelement",
        "is_inference",
        "_is_view",
    ]
    found: set[Any] = set()
    for name in getters:
        desc = base.__dict__.get(name)
        if desc is not None and hasattr(desc, "__get__"):
            found.add(desc.__get__)
    for name in methods:
        fn = getattr(torch.Tensor, name, None)
        if fn is not None:
            found.add(fn)
    return frozenset(found)


_METADATA = _metadata_functions()


def _collect(a: Any, local: dict[int, tuple[ScopeRecord, int]], foreign: bool) -> None:
    if type(a) is ScopeOutput:
        tag = tag_of(a)
        if tag is None:
            return
        rec = tag[1]
        if not rec.closed and not (foreign and rec.mixed):
            local[a.untyped_storage()._cdata] = (rec, rec.slot_base[tag[2]])
    elif type(a) is list or type(a) is tuple:
        for x in a:
            if type(x) is ScopeOutput:
                _collect(x, local, foreign)


def _adopt_aliases(out: Any, local: dict[int, tuple[ScopeRecord, int]]) -> None:
    flat = out if isinstance(out, (tuple, list)) else (out,)
    for o in flat:
        if type(o) is not torch.Tensor:
            continue
        try:
            hit = local.get(o.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            continue
        if hit is not None:
            hit[0].adopt(o, hit[1])


class ScopeOutput(torch.Tensor):
    """A tensor a ``gradient_checkpoint_scope`` produced, seen after the scope.

    The same tensor object (only its Python class changes at scope exit). An
    operator that consumes it pushes the scope's pack hook for the duration of that
    one call, so what the operator saves of it becomes a recompute handle. Turns
    back into a plain ``torch.Tensor`` when its scope's record closes.
    """

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        for tp in types:
            if tp is not cls and tp.__torch_function__ is not _DISABLED_TF:
                return NotImplemented
        with torch._C.DisableTorchFunctionSubclass():
            if func in _METADATA:
                return func(*args, **kwargs)
            local: dict[int, tuple[ScopeRecord, int]] | None = None
            top = None
            # Inside another scope the output is an input of that scope, which
            # holds it for its replay anyway: saving it as usual costs nothing.
            if (
                torch.is_grad_enabled()
                and _hooks_enabled()
                and recording_record() is None
            ):
                top = _top_hooks(True)
                # The scope's handles win over another hook on top (an offload
                # hook) except under torch.utils.checkpoint, which holds its inputs
                # and must save the same tensors on forward and on its recompute,
                # and for a record whose tensors such a hook saw inside the scope.
                foreign = top is not None and not is_our_hook(top)
                if not (foreign and _is_torch_checkpoint_hook(top)):
                    local = {}
                    for a in args:
                        _collect(a, local, foreign)
                    for a in kwargs.values():
                        _collect(a, local, foreign)
            if not local:
                return func(*args, **kwargs)
            hooks = PackHooks(None, local, top)
            _push_hooks(hooks.pack, hooks.unpack)
            try:
                out = func(*args, **kwargs)
            finally:
                _pop_hooks()
            _adopt_aliases(out, local)
            return out

    def __reduce_ex__(self, proto: Any) -> Any:
        return _as_plain(self, lambda t: t.__reduce_ex__(proto))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _as_plain(self, lambda t: t.__deepcopy__(memo))


def _as_plain(t: ScopeOutput, fn: Any) -> Any:
    """Run ``fn(t)`` with ``t`` seen as a plain tensor (copies and pickles are
    plain tensors: they are not the scope's output)."""
    t.__class__ = torch.Tensor
    try:
        return fn(t)
    finally:
        t.__class__ = ScopeOutput
