"""Placeholders: storage-less stand-ins for skipped save-region outputs on replay.

A placeholder is a tensor subclass without data. It carries the shape, strides,
dtype, device and ``requires_grad`` of the output it stands for, so that replay code
that only passes it along (into another skipped save region, into the checkpoint's
return value, or nowhere) runs unchanged. View ops on a placeholder give placeholders
(computed on a ``meta`` twin, so no data is ever touched). Any other op reads data
and raises :class:`~remat_dist.errors.PlaceholderAccessError`, naming the producing
region and the two fixes.

Only ops that touch a placeholder pay for the subclass dispatch; ordinary replay ops
never see it, and no dispatch mode is installed.
"""

from __future__ import annotations

from typing import Any

import torch

from remat_dist._errors import PlaceholderAccessError
from remat_dist._torch import _tensor
from remat_dist._torch._pytree import tree_map
from remat_dist.core._state import is_recomputing

__all__ = ["Placeholder", "is_placeholder", "make_placeholder"]


class Placeholder(torch.Tensor):
    """Stand-in for output ``index`` of save region ``origin`` during replay."""

    _meta: torch.Tensor
    _origin: str
    _checkpoint: str
    _index: int

    @staticmethod
    def __new__(
        cls,
        meta: torch.Tensor,
        device: torch.device,
        requires_grad: bool,
        checkpoint: str,
        origin: str,
        index: int,
    ) -> Placeholder:
        out = _tensor.make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride(),
            storage_offset=meta.storage_offset(),
            dtype=meta.dtype,
            device=device,
            requires_grad=requires_grad,
        )
        out._meta = meta
        out._checkpoint = checkpoint
        out._origin = origin
        out._index = index
        return out

    __torch_function__ = _tensor.disabled_torch_function_impl

    def __repr__(self) -> str:  # never touches data
        return (
            f"Placeholder(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}, region={self._origin!r}, output={self._index})"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = _first_placeholder((args, kwargs))
        if func.is_view:
            meta_out = func(*_to_meta(args), **_to_meta(kwargs))
            return tree_map(lambda m: _rewrap(m, first), meta_out)
        where = (
            f"the replay of checkpoint {first._checkpoint!r} read"
            if is_recomputing()
            else f"backward, after the replay of checkpoint {first._checkpoint!r}, read "
            "(in the gradient formula of an op of the replay that saved it: for "
            "example cos saves its input and its backward computes sin of it)"
        )
        raise PlaceholderAccessError(
            f"remat_dist: {where} the data "
            f"of output {first._index} of save region {first._origin!r} "
            f"(shape {tuple(first.shape)}, {first.dtype}) in op {func}, but that "
            "region is skipped on replay and its output was not persisted. Fix: call "
            "remat_dist.recompute_needs_tensor(output) right after the region in the "
            "forward (keeps it for replay), or do the consuming computation inside a "
            "remat_dist.region(...) call (regions persist what they consume)."
        )


def _first_placeholder(tree: Any) -> Placeholder:
    found: list[Placeholder] = []

    def visit(x: Any) -> Any:
        if isinstance(x, Placeholder) and not found:
            found.append(x)
        return x

    tree_map(visit, tree)
    return found[0]


def _to_meta(tree: Any) -> Any:
    return tree_map(lambda x: x._meta if isinstance(x, Placeholder) else x, tree)


def _rewrap(meta: Any, like: Placeholder) -> Any:
    if not isinstance(meta, torch.Tensor):
        return meta
    return Placeholder(
        meta, like.device, False, like._checkpoint, like._origin, like._index
    )


def make_placeholder(
    like: tuple[torch.Size, tuple[int, ...], int, torch.dtype, torch.device, bool],
    checkpoint: str,
    origin: str,
    index: int,
) -> Placeholder:
    """A placeholder with the recorded metadata ``like`` of a forward output."""
    shape, stride, offset, dtype, device, requires_grad = like
    meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    if offset:
        meta = meta.as_strided(shape, stride, offset)
    return Placeholder(meta, device, requires_grad, checkpoint, origin, index)


def is_placeholder(tensor: Any) -> bool:
    """Whether ``tensor`` is a placeholder: a skipped kept region's output during
    replay (or a view of one).

    Args:
        tensor: any object; non-tensors give ``False``.

    Returns:
        ``True`` for a placeholder.

    Example::

        >>> def block(x):
        ...     attn = remat_dist.region(attention, "attention", recompute=False)(x)
        ...     if remat_dist.is_placeholder(attn):
        ...         pass  # replaying: attn's values are not available here
        ...     return remat_dist.region(mlp, "mlp", recompute=True)(attn)
    """
    return isinstance(tensor, Placeholder)
