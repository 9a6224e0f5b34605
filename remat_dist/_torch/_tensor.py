"""Tensor-level private pieces: wrapper subclasses, switching ``__torch_function__``
off, the dispatch mode stack, storage weak references, autocast's state and
conjugate/negative views."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
    is_traceable_wrapper_subclass,
)

__all__ = [
    "DisableTorchFunction",
    "DisableTorchFunctionSubclass",
    "TensorBase",
    "TorchDispatchMode",
    "any_autocast_enabled",
    "current_dispatch_modes",
    "disabled_torch_function_impl",
    "free_storage_weak_ref",
    "is_view",
    "is_traceable_wrapper_subclass",
    "make_wrapper_subclass",
    "neg_view",
    "pop_dispatch_mode",
    "push_dispatch_mode",
    "storage_weak_ref",
]

DisableTorchFunction: Any = torch._C.DisableTorchFunction
"""Context manager: ``__torch_function__`` off for every tensor."""
DisableTorchFunctionSubclass: Any = torch._C.DisableTorchFunctionSubclass
"""Context manager: ``__torch_function__`` of tensor subclasses off."""
disabled_torch_function_impl: Any = torch._C._disabled_torch_function_impl
"""A subclass's ``__torch_function__`` that leaves it to ``__torch_dispatch__``."""
TensorBase: type = torch._C.TensorBase
"""The C base class of ``torch.Tensor`` (its attributes bypass subclass overrides)."""
make_wrapper_subclass: Callable[..., torch.Tensor] = torch.Tensor._make_wrapper_subclass
"""``make_wrapper_subclass(cls, size, ...)``: a tensor of class ``cls`` with no data."""
any_autocast_enabled: Callable[[], bool] = torch._C._is_any_autocast_enabled
"""Whether autocast is on for any device type."""
neg_view: Callable[[torch.Tensor], torch.Tensor] = torch._neg_view
"""The negative-bit view of a tensor (undoes ``resolve_neg``)."""
free_storage_weak_ref: Callable[[int], None] = torch.UntypedStorage._free_weak_ref
"""Free a weak reference made by :func:`storage_weak_ref`."""

current_dispatch_modes: Callable[[], list[Any]] = _get_current_dispatch_mode_stack
"""This thread's ``TorchDispatchMode`` stack, outermost first."""
push_dispatch_mode: Callable[[Any], None] = _push_mode
"""Push a dispatch mode (without entering it as a context manager)."""
pop_dispatch_mode: Callable[..., Any] = _pop_mode
"""Pop the innermost dispatch mode and return it."""


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor (its ``_base``)."""
    return t._is_view()


def storage_weak_ref(storage: Any) -> int:
    """A weak reference (a handle) to ``storage``; free it with
    :func:`free_storage_weak_ref`."""
    return storage._weak_ref()
