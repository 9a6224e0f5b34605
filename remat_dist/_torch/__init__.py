"""The one seam between remat_dist and torch's private internals.

Every private torch piece remat_dist relies upon (``torch._C`` functions, private
modules such as ``torch.utils._pytree`` or ``torch._dynamo``, private attributes of
torch's classes) is named and reached in this package only, one module per
concern; the rest of remat_dist imports the small named functions and constants
those modules expose (``tests/test_torch_seam.py`` fails on a private torch
reference anywhere else).

Importing this package checks that the installed torch has every piece listed in
:data:`REQUIRED` and raises :class:`ImportError` naming the first missing one and
the torch versions remat_dist supports. Nothing of remat_dist is imported here
but ``_errors``; the modules of this package import nothing of remat_dist.

| module | concern |
|---|---|
| ``_autograd`` | the saved-tensor hooks stack, graph tasks and what they run, nodes |
| ``_checkpoint`` | ``torch.utils.checkpoint``'s internals and torch's checkpoint wrapper |
| ``_dispatch`` | dispatch keys, the thread-local included set, op handles, HOPs |
| ``_tensor`` | tensor subclasses, torch-function and dispatch modes, storages, autocast |
| ``_pytree`` | flattening nested containers |
| ``_module`` | ``nn.Module``'s private call path and buffers |
| ``_dynamo`` | Dynamo's reset, constant folding and config |
| ``_c10d`` | c10d works from futures, the default store |
| ``_dtensor`` | DTensor's RNG tracker, whether its view rule takes sequence shards |
| ``_fsdp`` | recognising FSDP2's own collectives |
| ``_cuda`` | the CUDA caching allocator's snapshot and OOM observer |
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = [
    "REQUIRED",
    "SUPPORTED_TORCH",
    "TESTED_TORCH",
    "TORCH_RELEASE",
    "check_torch",
    "missing_pieces",
    "unsupported_torch_message",
]

SUPPORTED_TORCH = ">=2.11"
"""The torch versions remat_dist supports (``pyproject.toml`` declares the same): no
upper bound, so installing remat_dist never changes a user's torch; a newer torch
lacking a private piece fails the check at import, naming it."""

TESTED_TORCH = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")
"""The torch releases CI runs the suite on, one per minor release
(``scripts/test_torch_matrix.sh`` reads them here): a new release is one more
entry. The differences between them are handled in this package, each where its
concern lives, naming the releases it serves (``docs/torch_versions.md``)."""


TORCH_RELEASE: tuple[int, int] = tuple(  # type: ignore[assignment]
    int("".join(c for c in part if c.isdigit()) or 0)
    for part in torch.__version__.split("+")[0].split(".")[:2]
)
"""The installed torch's ``(major, minor)``: for what only a release number tells
(a test's expectation of torch's own behaviour); the seam's modules detect what
torch has instead."""


def tested_range() -> str:
    """``"2.11 to 2.15"``: the minor releases of :data:`TESTED_TORCH`."""
    minors = [".".join(v.split(".")[:2]) for v in TESTED_TORCH]
    return f"{minors[0]} to {minors[-1]}"


def unsupported_torch_message(piece: str) -> str:
    """The error for an installed torch that lacks ``piece`` (a dotted path)."""
    return (
        f"remat_dist supports torch{SUPPORTED_TORCH} (tested on {tested_range()}): "
        f"the installed torch {torch.__version__} has no {piece}. Install a tested "
        f"torch (pip install 'torch=={TESTED_TORCH[-1]}')."
    )

_CORE = (
    # _autograd
    "torch._C._autograd._top_saved_tensors_default_hooks",
    "torch._C._autograd._push_saved_tensors_default_hooks",
    "torch._C._autograd._pop_saved_tensors_default_hooks",
    "torch._C._autograd._saved_tensors_hooks_is_enabled",
    "torch._C._autograd._saved_tensors_hooks_enable",
    "torch._C._autograd._saved_tensors_hooks_disable",
    "torch._C._autograd._saved_tensors_hooks_get_disabled_error_message",
    "torch._C._current_graph_task_id",
    "torch._C._autograd._get_current_graph_task_keep_graph",
    "torch._C._current_autograd_node",
    "torch._C._will_engine_execute_node",
    "torch._C._autograd._get_sequence_nr",
    "torch.autograd.Variable._execution_engine.queue_callback",
    # _checkpoint
    "torch.utils.checkpoint._StopRecomputationError",
    "torch.utils.checkpoint._enable_checkpoint_early_stop",
    "torch.utils.checkpoint._Holder",
    "torch.utils.checkpoint._CheckpointFrame",
    "torch.utils.checkpoint._checkpoint_hook",
    "torch.utils.checkpoint._recomputation_hook",
    "torch.utils.checkpoint._allowed_determinism_checks_to_fns",
    "torch.utils.checkpoint._checkpoint_without_reentrant_generator",
    "torch.utils.checkpoint._DEFAULT_DETERMINISM_MODE",
    # _dispatch
    "torch._C._parse_dispatch_key",
    "torch._C._dispatch_has_backend_fallback",
    "torch._C._dispatch_get_registrations_for_dispatch_key",
    "torch._C._dispatch_get_all_op_names",
    "torch._C._dispatch_keyset_full_after",
    "torch._C._dispatch_tls_is_dispatch_key_included",
    "torch._C._dispatch_tls_set_dispatch_key_included",
    "torch._ops._HIGHER_ORDER_OP_DEFAULT_FALLTHROUGH_DISPATCH_KEYS",
    "torch._ops._higher_order_ops",
    "torch.ops.aten.mul.Tensor._handle.redispatch_boxed",
    # _tensor
    "torch.utils._python_dispatch.TorchDispatchMode",
    "torch.utils._python_dispatch.is_traceable_wrapper_subclass",
    "torch.utils._python_dispatch._get_current_dispatch_mode_stack",
    "torch.utils._python_dispatch._push_mode",
    "torch.utils._python_dispatch._pop_mode",
    "torch._C.DisableTorchFunction",
    "torch._C.DisableTorchFunctionSubclass",
    "torch._C._disabled_torch_function_impl",
    "torch._C.TensorBase",
    "torch._C._is_any_autocast_enabled",
    "torch.Tensor._make_wrapper_subclass",
    "torch.UntypedStorage._free_weak_ref",
    "torch.UntypedStorage._weak_ref",
    "torch._neg_view",
    # _pytree
    "torch.utils._pytree.keystr",
    "torch.utils._pytree.tree_flatten_with_path",
    "torch.utils._pytree.tree_leaves",
    "torch.utils._pytree.tree_map",
    # _module
    "torch.nn.Module._call_impl",
    "torch.nn.Module._wrapped_call_impl",
    "torch.nn.modules.dropout._DropoutNd",
    # _dynamo
    "torch._dynamo.reset",
    "torch._dynamo.assume_constant_result",
    "torch._dynamo.config.cache_size_limit",
    "torch._dynamo.config.patch",
    "torch._dynamo.lookup_backend",
    "torch._functorch.config.patch",
    # _cuda (Python side, present in every build)
    "torch.cuda.memory._snapshot",
)

_DISTRIBUTED = (
    "torch._C._distributed_c10d._create_work_from_future",
    "torch._C._distributed_c10d",
    "torch.ops._c10d_functional.wait_tensor",
    "torch.distributed.distributed_c10d._get_default_store",
    "torch.distributed.distributed_c10d._world._default_pg",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup.unshard",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup.post_backward",
    "torch.distributed.tensor._random",
    "torch.distributed.tensor._ops._view_ops.view_groups",
    "torch.distributed.tensor._ops._view_ops.propagate_shape_and_sharding",
)

_CUDA_BUILD = ("torch._C._cuda_attach_out_of_memory_observer",)


def _required() -> tuple[str, ...]:
    out = _CORE
    if torch.distributed.is_available():
        out += _DISTRIBUTED
    if torch.backends.cuda.is_built():
        out += _CUDA_BUILD
    return out


REQUIRED: tuple[str, ...] = _required()
"""Every private torch piece remat_dist relies upon on this build, as dotted paths
(the distributed ones where ``torch.distributed`` is available, the CUDA ones in a
CUDA build)."""


def _resolve(path: str) -> Any:
    """The object at dotted ``path``, importing modules along it; raises
    ``AttributeError`` / ``ImportError`` when a piece is missing."""
    parts = path.split(".")
    obj: Any = importlib.import_module(parts[0])
    name = parts[0]
    for part in parts[1:]:
        name = f"{name}.{part}"
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            obj = importlib.import_module(name)
    return obj


def missing_pieces(paths: tuple[str, ...] = REQUIRED) -> list[str]:
    """The dotted paths of ``paths`` the installed torch lacks."""
    missing = []
    for path in paths:
        try:
            _resolve(path)
        except (ImportError, AttributeError, RuntimeError):
            missing.append(path)
    return missing


def check_torch() -> None:
    """Raise :class:`ImportError` if the installed torch lacks a private piece
    remat_dist relies upon, naming it and the supported torch versions."""
    missing = missing_pieces()
    if missing:
        more = f" (nor {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise ImportError(unsupported_torch_message(missing[0] + more))


check_torch()
