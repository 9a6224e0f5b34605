"""What core leaves on the autograd graph, and the public way to read it back.

A save region packs each tensor it saves as a :class:`_Kept` (the tensor itself) or
a :class:`_UserPacked` (what the user's pack hook returned);
``gradient_checkpoint_scope`` packs a ``_Handle``; a checkpoint's output nodes carry
weak references to its record in ``grad_fn.metadata``. Reports walk the graph and
must tell these apart: :func:`classify_packed` and :func:`records_of_node` let them
do so without importing core's private types, which can then change here alone.
"""

from __future__ import annotations

import enum
import weakref
from typing import TYPE_CHECKING, Any

import torch

from remat_dist._torch._pytree import tree_leaves
from remat_dist.core._scope_record import _Handle

if TYPE_CHECKING:
    from remat_dist.core._hooks import saved_tensors_hooks
    from remat_dist.core._record import CheckpointRecord

__all__ = ["PackedKind", "classify_packed", "records_of_node"]


RECORDS_METADATA_KEY = "remat_dist.records"
"""``grad_fn.metadata`` key of a checkpoint output's node: weak refs to records."""


class _Kept:
    """A save region's save kept as the tensor itself, detached, with its version
    at pack time (autograd skips its own version check for hooked saves)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor = tensor
        self.version = version


class _UserPacked:
    """A save region's save packed by the user's ``saved_tensors_hooks``: the hooks
    that unpack it, and what their pack returned."""

    __slots__ = ("hooks", "packed")

    def __init__(self, hooks: saved_tensors_hooks, packed: Any) -> None:
        self.hooks = hooks
        self.packed = packed


def _link_to_graph(record: CheckpointRecord, out: Any) -> None:
    """Let graph walks (reports) find the record from the output nodes, weakly."""
    ref = weakref.ref(record)
    for t in (out,) if isinstance(out, torch.Tensor) else tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            t.grad_fn.metadata.setdefault(RECORDS_METADATA_KEY, []).append(ref)


class PackedKind(enum.Enum):
    """Which of core's packed saved-tensor objects :func:`classify_packed` found."""

    REGION_KEPT = "region_kept"
    """A save region kept the tensor itself; payload: that tensor."""
    REGION_USER_PACKED = "region_user_packed"
    """A save region's save packed by a user hook; payload: what the hook's pack
    returned (count its tensors, do not unpack it)."""
    SCOPE_HANDLE = "scope_handle"
    """A ``gradient_checkpoint_scope`` tensor, recomputed on unpack; payload: the
    scope's record."""


def classify_packed(obj: Any) -> tuple[PackedKind, Any] | None:
    """The kind and payload of a packed saved-tensor object that core made.

    ``obj`` is what a saved tensor holds packed (``SavedTensor.data``, read without
    unpacking). ``None`` for anything else: plain tensors, torch's own checkpoint
    stand-ins, objects of other pack hooks.
    """
    if isinstance(obj, _Kept):
        return PackedKind.REGION_KEPT, obj.tensor
    if isinstance(obj, _UserPacked):
        return PackedKind.REGION_USER_PACKED, obj.packed
    if isinstance(obj, _Handle):
        return PackedKind.SCOPE_HANDLE, obj.record
    return None


def records_of_node(node: Any) -> list[CheckpointRecord]:
    """The live checkpoint records whose outputs ``node`` produced.

    Reads what :func:`_link_to_graph` left in ``node.metadata``; records already
    freed are left out. Empty for any other node.
    """
    metadata = getattr(node, "metadata", None)
    refs = metadata.get(RECORDS_METADATA_KEY) if metadata else None
    records = []
    for ref in refs or ():
        record = ref() if isinstance(ref, weakref.ref) else ref
        if record is not None:
            records.append(record)
    return records
