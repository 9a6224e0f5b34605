"""Storage identity and size: the one home of "which bytes does this tensor hold".

Reports, byte counters and the core all ask the same two questions of a saved
tensor: which storage holds its data (views share one) and how large that storage
is. A tensor subclass such as DTensor has no storage of its own: its first inner
tensor (a DTensor's local shard) answers for it.
"""

from __future__ import annotations

import torch

__all__ = ["StorageKey", "TensorMeta", "plain", "storage_key", "storage_nbytes", "tensor_meta"]

StorageKey = tuple[torch.device, int]
"""``(device, storage object id)`` of a tensor's data."""

TensorMeta = tuple[torch.Size, tuple[int, ...], int, torch.dtype, torch.device, bool]


def plain(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose storage holds ``t``'s data.

    Traceable wrapper subclasses (DTensor, ...) have no storage of their own; they
    name their inner tensors in ``__tensor_flatten__``. The first inner tensor is
    taken (a DTensor's local shard), recursively.
    """
    while type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is None:
            return t
        names, _ = flatten()
        if not names:
            return t
        t = getattr(t, names[0])
    return t


def storage_key(t: torch.Tensor) -> StorageKey:
    """Identity of the storage behind ``t`` (views share it).

    The storage object, not its address: FSDP2 frees unsharded parameters after
    forward (their storage is resized to 0 but stays alive on the graph), and the
    allocator hands the freed address to later tensors.
    """
    t = plain(t)
    return (t.device, t.untyped_storage()._cdata)


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the whole storage behind ``t`` (a view costs its base's storage)."""
    return plain(t).untyped_storage().nbytes()


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    """What a stand-in or placeholder needs to look like ``t``."""
    return (
        t.shape,
        t.stride(),
        t.storage_offset(),
        t.dtype,
        t.device,
        t.requires_grad,
    )
