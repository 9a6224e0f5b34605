"""Tags and small types of a ``gradient_checkpoint_scope`` record.

The thread flags that keep the scope from recording its own work, the context
variable naming the scope recording now, the table that tells which object is
which recorded output (a *tag*: weak reference, record, slot), and the small
types a record is made of: the references that stand for tensors in recorded
arguments, a recorded operator (:class:`_Op`) and a storage the scope allocated
(:class:`_Base`). See :mod:`remat_dist.core._scope_record` for how they fit.
"""

from __future__ import annotations

import threading
import weakref
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from remat_dist._torch._tensor import DisableTorchFunctionSubclass

if TYPE_CHECKING:
    from remat_dist.core._scope_record import ScopeRecord


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
        with DisableTorchFunctionSubclass():
            return t._version
    except RuntimeError:
        # Inference tensors have no version counter.
        return None


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        if type(t) is torch.Tensor:
            return t.untyped_storage()._cdata
        with DisableTorchFunctionSubclass():
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

