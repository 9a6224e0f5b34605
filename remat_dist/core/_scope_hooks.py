"""The saved-tensor hook pair of ``gradient_checkpoint_scope``.

:class:`PackHooks` decides, for each tensor autograd saves while a scope records
(or while one operator after the scope consumes its outputs), whether it becomes
a replay :class:`~remat_dist.core._scope_replay._Handle`, goes to the hook that
was on top before, or is kept as usual. Also the aliases of torch's hook-stack
primitives the scope modules share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from remat_dist._torch import _autograd
from remat_dist._torch._tensor import DisableTorchFunctionSubclass
from remat_dist.core._scope_replay import _Handle
from remat_dist.core._scope_tags import (
    FLAGS,
    _storage_key,
    _version,
    recording_record,
)

if TYPE_CHECKING:
    from remat_dist.core._scope_record import ScopeRecord

_top_hooks = _autograd.top_saved_tensors_hooks
_push_hooks = _autograd.push_saved_tensors_hooks
_pop_hooks = _autograd.pop_saved_tensors_hooks
_hooks_enabled = _autograd.saved_tensors_hooks_enabled


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
            with DisableTorchFunctionSubclass():
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

