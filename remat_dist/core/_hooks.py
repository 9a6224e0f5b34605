"""Saved-tensor hooks that also see what a checkpoint keeps, and named saves.

``torch.autograd.graph.saved_tensors_hooks`` only sees what autograd packs while the
hook is innermost. Inside a checkpoint the innermost hook is the checkpoint's own, so
a plain torch hook never sees what a save region keeps or what replay must be fed.
:class:`saved_tensors_hooks` registers itself with remat_dist too, so the runtime can
route those tensors through it (offloading saved activations to CPU works through
it), and tells the pack hook why it is called (:func:`current_saved_tensor_info`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Any

import torch

from remat_dist.core._state import hooks_var
from remat_dist.core._storage import storage_key
from remat_dist.core._types import SavedTensorInfo, SavedTensorKind
from remat_dist.errors import RematUsageError

__all__ = [
    "current_saved_tensor_info",
    "save_for_backward",
    "saved_tensors_hooks",
]

_info_var: ContextVar[SavedTensorInfo | None] = ContextVar(
    "remat_dist_pack_info", default=None
)
inputs_of_var: ContextVar[str | None] = ContextVar(
    "remat_dist_packing_inputs_of", default=None
)
"""Set to a checkpoint's name while torch packs that checkpoint's inputs."""

_pending_names: ContextVar[dict[tuple[Any, ...], str] | None] = ContextVar(
    "remat_dist_pending_names", default=None
)


def _name_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (*storage_key(t), t.storage_offset(), t.shape)


def saved_name(t: torch.Tensor) -> str | None:
    """The ``save_for_backward`` name given to ``t`` by the Function now packing."""
    names = _pending_names.get()
    if not names:
        return None
    return names.get(_name_key(t))


def save_for_backward(ctx: Any, tensors: Mapping[str, torch.Tensor | None]) -> None:
    """``ctx.save_for_backward`` with names, so that memory reports show them.

    Call it from a custom ``autograd.Function.forward``; ``ctx.saved_tensors`` gives
    the tensors back in the mapping's order::

        remat_dist.save_for_backward(ctx, {"lse": lse, "probs": probs})
    """
    if not isinstance(tensors, Mapping):
        raise RematUsageError(
            "remat_dist.save_for_backward(ctx, tensors) takes a mapping of "
            f"name -> tensor, got {type(tensors).__name__}. Fix: pass "
            "{'name': tensor, ...}."
        )
    names: dict[tuple[Any, ...], str] = {}
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise RematUsageError(
                f"remat_dist.save_for_backward: names must be non-empty strings, got "
                f"{name!r}. Fix: use names such as 'lse' or 'probs'."
            )
        if t is not None:
            names[_name_key(t)] = name
    # torch packs the tensors when the Function's forward returns, before the next
    # Function can call this again, so one pending mapping is all that is needed.
    _pending_names.set(names)
    ctx.save_for_backward(*tensors.values())


def current_saved_tensor_info() -> SavedTensorInfo:
    """Inside a pack hook of :class:`saved_tensors_hooks`: why this tensor is packed.

    Raises :class:`~remat_dist.errors.RematUsageError` when called anywhere else.
    """
    info = _info_var.get()
    if info is None:
        raise RematUsageError(
            "remat_dist.current_saved_tensor_info() was called outside a pack hook. "
            "Fix: call it only from the pack function given to "
            "remat_dist.saved_tensors_hooks(pack, unpack)."
        )
    return info


class saved_tensors_hooks:  # noqa: N801 - mirrors torch's context manager name
    """Like ``torch.autograd.graph.saved_tensors_hooks``, and more.

    Besides what autograd packs while the hooks are innermost, ``pack`` also sees the
    inputs of checkpoints entered under it (``SavedTensorKind.CHECKPOINT_INPUT``),
    what save regions keep (``BACKWARD``) and the save-region outputs persisted for
    replay (``SAVE_OUTPUT``). Call :func:`current_saved_tensor_info` inside ``pack``
    to tell them apart.

    Args:
        pack: ``tensor -> packed``.
        unpack: ``packed -> tensor``.
        capture_context: optional ``() -> context manager``, called at pack time;
            the context manager is entered around the matching ``unpack`` (for
            example to restore the stream or device the tensor was packed under).
    """

    def __init__(
        self,
        pack: Callable[[torch.Tensor], Any],
        unpack: Callable[[Any], torch.Tensor],
        *,
        capture_context: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> None:
        if not callable(pack) or not callable(unpack):
            raise RematUsageError(
                "remat_dist.saved_tensors_hooks(pack, unpack): both must be callables."
            )
        self.pack = pack
        self.unpack = unpack
        self.capture_context = capture_context
        self._stack: list[tuple[Any, Any]] = []

    def pack_with(self, t: torch.Tensor, info: SavedTensorInfo) -> tuple[Any, Any]:
        token = _info_var.set(info)
        try:
            packed = self.pack(t)
        finally:
            _info_var.reset(token)
        ctx = self.capture_context() if self.capture_context is not None else None
        return packed, ctx

    def unpack_with(self, packed: tuple[Any, Any]) -> torch.Tensor:
        value, ctx = packed
        if ctx is None:
            return self.unpack(value)
        with ctx:
            return self.unpack(value)

    def _pack_outer(self, t: torch.Tensor) -> tuple[Any, Any]:
        ckpt = inputs_of_var.get()
        if ckpt is not None:
            info = SavedTensorInfo(SavedTensorKind.CHECKPOINT_INPUT, checkpoint=ckpt)
        else:
            info = SavedTensorInfo(SavedTensorKind.BACKWARD, name=saved_name(t))
        return self.pack_with(t, info)

    def __enter__(self) -> saved_tensors_hooks:
        token = hooks_var.set(hooks_var.get() + (self,))
        torch_hooks = torch.autograd.graph.saved_tensors_hooks(
            self._pack_outer, self.unpack_with
        )
        torch_hooks.__enter__()
        self._stack.append((token, torch_hooks))
        return self

    def __exit__(self, *exc: Any) -> None:
        token, torch_hooks = self._stack.pop()
        torch_hooks.__exit__(*exc)
        hooks_var.reset(token)


def innermost_hooks() -> saved_tensors_hooks | None:
    """The innermost :class:`saved_tensors_hooks` active in this context."""
    stack = hooks_var.get()
    return stack[-1] if stack else None


def as_hooks(value: Any, where: str) -> saved_tensors_hooks | None:
    """Normalise a ``saved_tensors_hooks=`` option: hooks object or (pack, unpack)."""
    if value is None or isinstance(value, saved_tensors_hooks):
        return value
    if isinstance(value, tuple) and len(value) == 2 and all(map(callable, value)):
        return saved_tensors_hooks(*value)
    raise RematUsageError(
        f"remat_dist.checkpoint(region_name={where!r}): saved_tensors_hooks must be a "
        "remat_dist.saved_tensors_hooks(pack, unpack) or a (pack, unpack) tuple, got "
        f"{type(value).__name__}."
    )
