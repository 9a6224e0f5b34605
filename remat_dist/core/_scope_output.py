"""A scope's outputs after the scope has exited.

At scope exit the outputs still referenced become :class:`ScopeOutput` (same
object, new class): an operator that consumes one pushes the scope's
:class:`~remat_dist.core._scope_hooks.PackHooks` for that one call, so what it
saves of the output becomes a replay handle too. Here also the record-side
steps: turning a record's outputs into :class:`ScopeOutput` at exit
(:func:`swap_outputs`, :func:`swap`) and back into plain tensors at close
(:func:`release_outputs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from remat_dist._torch import _tensor
from remat_dist.core._scope_hooks import (
    PackHooks,
    _hooks_enabled,
    _is_torch_checkpoint_hook,
    _pop_hooks,
    _push_hooks,
    _top_hooks,
    is_our_hook,
)
from remat_dist.core._scope_tags import (
    _TAGS,
    _SwapRef,
    _untag,
    _version,
    recording_record,
    tag_of,
)

if TYPE_CHECKING:
    from remat_dist.core._scope_record import ScopeRecord

_DISABLED_TF = _tensor.disabled_torch_function_impl


def _metadata_functions() -> frozenset[Any]:
    """Tensor attribute getters and methods that neither save nor alias a tensor:
    a scope output answers them without the hook."""
    base = _tensor.TensorBase
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
        with _tensor.DisableTorchFunctionSubclass():
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


# --- record side: outputs at scope exit and at close ------------------------------


def swap_outputs(record: ScopeRecord) -> None:
    """At scope exit (lock held): note each live output's version and turn those
    that are plain tensors into :class:`ScopeOutput`; forget the dead ones."""
    tags, record._tags = record._tags, []
    for key, entry in tags:
        o = entry[0]()
        if o is None:
            _untag(key, entry)
            continue
        slot = entry[2]
        record.bases[record.slot_base[slot]].exit_version = _version(o)
        if type(o) is torch.Tensor and _TAGS.get(key) is entry:
            swap(record, o, slot)
        else:
            record._tags.append((key, entry))  # untagged at close


def swap(record: ScopeRecord, o: torch.Tensor, slot: int) -> None:
    """Make ``o`` a :class:`ScopeOutput` of ``record`` standing for ``slot``."""
    entry = (_SwapRef(o, record), record, slot)
    _TAGS[id(o)] = entry
    record._swapped.append((id(o), entry))
    o.__class__ = ScopeOutput
    record.alive_swapped += 1


def release_outputs(record: ScopeRecord) -> None:
    """At close (lock held): turn the record's outputs back into plain tensors
    and drop all its tags."""
    swapped, record._swapped = record._swapped, []
    tags, record._tags = record._tags, []
    record.alive_swapped = 0
    for key, entry in swapped:
        ref = entry[0]
        ref.live = False
        o = ref()
        if o is not None and type(o) is ScopeOutput:
            o.__class__ = torch.Tensor
        _untag(key, entry)
    for key, entry in tags:
        _untag(key, entry)
