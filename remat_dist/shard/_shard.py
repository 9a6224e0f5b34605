"""``shard_model``: tensor parallelism (optional) and FSDP2 per block and root.

Order of work, the one torchtitan uses: tensor-parallel ``parallelize_module`` on
the TP sub-mesh, then ``fully_shard`` on each block, then on the root. Activation
checkpointing applied by :func:`remat_dist.apply_remat` may come before or
after: it changes neither module types nor hooks that TP or FSDP2 install (see
``remat_dist.wrap._apply``), so both orders give the same model; the one layout
that cannot work (a checkpointed module that contains FSDP units) is refused
whichever call comes second.

Block boundaries under sequence parallelism
-------------------------------------------
A sequence-parallel style (``SequenceParallel``, ``RowwiseParallel(output_layouts=
Shard(1))``, ...) takes a plain tensor it receives as *this rank's shard of the
sequence*. Hand it the full sequence and it silently computes garbage (measured on
this machine: gradients off by up to 1.1e-1, no error). ``shard_model`` therefore
keeps the tensors that cross a block boundary *full* (replicated over the TP
group): for a plan whose blocks expect a sequence shard at their input
(``block_input="sequence"``) it slices the block input to this rank's shard before
the block runs, and for ``block_output="sequence"`` it all-gathers the block output
afterwards. A plan that shards the sequence but does not say what its blocks
expect is refused, as is a root plan with sequence layouts (the blocks hand it full
tensors).
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

from remat_dist._errors import RematUsageError
from remat_dist._torch._tensor import is_view
from remat_dist.shard._tp_plan import (
    SEQUENCE,
    TensorParallelPlan,
    TPPlanLike,
    normalize_plan,
)
from remat_dist.wrap import (
    BlockSelector,
    check_no_fsdp_inside,
    checkpointed_names,
    select_blocks,
    strictly_inside,
)

__all__ = ["shard_model"]

TP_DIM = "tp"
FSDP_DIM_NAMES = ("dp", "fsdp", "dp_shard", "dp_replicate")


def _matches(module: nn.Module, key: str) -> list[str]:
    """Qualified names (relative to ``module``) that ``parallelize_module`` would
    apply plan key ``key`` to."""
    if key == "":
        return [""]
    found = [("", module)]
    for token in key.split("."):
        nxt = []
        for prefix, mod in found:
            for child_name, child in mod.named_children():
                if fnmatch.fnmatch(child_name, token):
                    nxt.append(
                        (f"{prefix}.{child_name}" if prefix else child_name, child)
                    )
        found = nxt
    return [n for n, _ in found]


# -- mesh ------------------------------------------------------------------------


def _split_mesh(mesh: Any, tp_plan: Any) -> tuple[Any | None, Any | None]:
    """(tp_mesh, fsdp_mesh) for ``mesh`` (either may be None)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise RematUsageError(
            f"remat_dist.shard_model: mesh must be a DeviceMesh, got "
            f"{type(mesh).__name__}. Fix: init_device_mesh('cpu', (dp, tp), "
            "mesh_dim_names=('dp', 'tp'))."
        )
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1:
        name = names[0] if names else None
        if tp_plan is None:
            if name == TP_DIM:
                raise RematUsageError(
                    "remat_dist.shard_model: the 1-D mesh is named 'tp' but no "
                    "tp_plan was given. Fix: pass tp_plan= (e.g. "
                    "remat_dist.shard.reference_tp_plan()), or name the dim 'dp' to "
                    "shard with FSDP2 only."
                )
            return None, mesh
        if name in FSDP_DIM_NAMES:
            raise RematUsageError(
                f"remat_dist.shard_model: tp_plan was given with a 1-D mesh named "
                f"{name!r}; a 1-D mesh is either FSDP or TP. Fix: name it 'tp' for "
                "tensor parallelism only, or pass a 2-D mesh ('dp', 'tp')."
            )
        return mesh, None
    if not names:
        raise RematUsageError(
            f"remat_dist.shard_model: a {mesh.ndim}-D mesh needs mesh_dim_names "
            "('dp' or 'fsdp' for FSDP2, 'tp' for tensor parallelism)."
        )
    if TP_DIM in names:
        if tp_plan is None:
            raise RematUsageError(
                f"remat_dist.shard_model: mesh dims {names} include 'tp' but no "
                "tp_plan was given. Fix: pass tp_plan= (e.g. "
                "remat_dist.shard.reference_tp_plan()), or drop the 'tp' dim."
            )
        others = tuple(n for n in names if n != TP_DIM)
        fsdp_mesh = mesh[others[0]] if len(others) == 1 else mesh[others]
        return mesh[TP_DIM], fsdp_mesh
    if tp_plan is not None:
        raise RematUsageError(
            f"remat_dist.shard_model: tp_plan was given but mesh dims {names} have no "
            "'tp' dim. Fix: name the tensor-parallel dim 'tp'."
        )
    return None, mesh  # HSDP: fully_shard takes the 2-D mesh as it is


# -- boundaries --------------------------------------------------------------------


def _sequence_input_hook(tp_mesh: Any, seq_dim: int, block_name: str) -> Any:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    degree = tp_mesh.size()

    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not args or not isinstance(args[0], torch.Tensor):
            raise RematUsageError(
                f"remat_dist.shard_model: block {block_name!r} runs sequence-parallel "
                "and needs its input tensor as the first positional argument."
            )
        x = args[0]
        if isinstance(x, DTensor):
            dx = x
        else:
            if x.shape[seq_dim] % degree:
                raise RematUsageError(
                    f"remat_dist.shard_model: block {block_name!r} input has sequence "
                    f"length {x.shape[seq_dim]} (dim {seq_dim}), not divisible by the "
                    f"tensor-parallel degree {degree}. Fix: pad the sequence or use "
                    "reference_tp_plan(sequence_parallel=False)."
                )
            dx = DTensor.from_local(x, tp_mesh, (Replicate(),), run_check=False)
        local = dx.redistribute(tp_mesh, (Shard(seq_dim),)).to_local()
        return (local, *args[1:])

    return hook


def _sequence_output_hook(tp_mesh: Any, seq_dim: int) -> Any:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def gather(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        dt = (
            t
            if isinstance(t, DTensor)
            else DTensor.from_local(t, tp_mesh, (Shard(seq_dim),), run_check=False)
        )
        full = dt.redistribute(tp_mesh, (Replicate(),)).to_local()
        # to_local() returns a view; FSDP2 warns about (and an in-place op on it
        # would drop) the pre-backward hook it attaches to a block's output.
        return full.clone() if is_view(full) else full

    def hook(module: nn.Module, args: Any, out: Any) -> Any:
        if isinstance(out, tuple):
            return (gather(out[0]), *out[1:])
        return gather(out)

    return hook


# -- shard_model -------------------------------------------------------------------


def shard_model(
    model: nn.Module,
    mesh: Any,
    *,
    blocks: BlockSelector,
    tp_plan: TPPlanLike | None = None,
    reshard_after_forward: bool = True,
    mp_policy: Any | None = None,
) -> nn.Module:
    """Shard ``model`` in place for FSDP2 (+ tensor parallelism); returns ``model``.

    Args:
        model: the model, with or without :func:`apply_remat` already applied.
        mesh: a ``DeviceMesh``. 1-D: FSDP2 only; with ``tp_plan``, a 1-D mesh is
            the TP mesh (TP only, dim named ``"tp"`` or unnamed). 2-D (or more):
            TP on the dim named ``"tp"``, FSDP2 on the others (``"dp"`` /
            ``"fsdp"``; two of them: HSDP). A 2-D mesh without ``"tp"`` is HSDP.
        blocks: the modules ``fully_shard`` wraps one by one (and that the TP block
            plan is applied to): module classes, a predicate or qualified names.
        tp_plan: a :class:`TensorParallelPlan` (``reference_tp_plan()``), or a dict
            of per-block ParallelStyles. Plans that shard the sequence must say what
            their blocks take and return (see the module docstring).
        reshard_after_forward: ``fully_shard``'s option, for blocks and root.
        mp_policy: a ``MixedPrecisionPolicy`` for every ``fully_shard`` call.

    Returns:
        ``model``, sharded in place.

    Raises:
        RematUsageError: a mesh that does not fit the plan, a plan that cannot be
            made correct, a model already sharded, or a checkpointed module
            (``apply_remat``) that would contain FSDP units.

    Example::

        >>> mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
        >>> tp_plan = {"attention.wq": ColwiseParallel(), "attention.wo": RowwiseParallel()}
        >>> remat_dist.apply_remat(model, blocks=Block, policy="full")
        >>> remat_dist.shard_model(model, mesh, blocks=Block, tp_plan=tp_plan)
    """
    if not isinstance(model, nn.Module):
        raise RematUsageError(
            f"remat_dist.shard_model: model must be an nn.Module, got "
            f"{type(model).__name__}."
        )
    if not isinstance(reshard_after_forward, bool):
        raise RematUsageError(
            "remat_dist.shard_model: reshard_after_forward must be True or False, got "
            f"{reshard_after_forward!r}."
        )
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    tp_mesh, fsdp_mesh = _split_mesh(mesh, tp_plan)
    plan = normalize_plan(tp_plan) if tp_plan is not None else None
    selected = select_blocks(model, blocks, caller="shard_model")
    block_names = [n for n, _ in selected]
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            raise RematUsageError(
                f"remat_dist.shard_model: {name or 'the root'!r} is already an FSDP "
                "module (fully_shard was applied). Fix: call shard_model once, on the "
                "unsharded model."
            )
    for outer in block_names:
        for inner in block_names:
            if strictly_inside(outer, inner):
                raise RematUsageError(
                    f"remat_dist.shard_model: block {inner!r} lies inside block "
                    f"{outer!r}. Fix: select one level of blocks."
                )
    if fsdp_mesh is not None:
        check_no_fsdp_inside(
            checkpointed_names(model),
            block_names,
            fix="pass the same blocks to apply_remat as to shard_model.",
        )

    if plan is not None:
        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise RematUsageError(
                "remat_dist.shard_model: the model already has DTensor parameters "
                "(tensor parallelism was applied). Fix: pass tp_plan only to an "
                "unparallelized model, or drop tp_plan."
            )
        _apply_tp(model, selected, plan, tp_mesh)

    if fsdp_mesh is not None:
        kwargs: dict[str, Any] = {
            "mesh": fsdp_mesh,
            "reshard_after_forward": reshard_after_forward,
        }
        if mp_policy is not None:
            kwargs["mp_policy"] = mp_policy
        for _, module in selected:
            fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
    return model


def _apply_tp(
    model: nn.Module,
    selected: list[tuple[str, nn.Module]],
    plan: TensorParallelPlan,
    tp_mesh: Any,
) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    # Check every key resolves before changing anything.
    for name, block in selected:
        for key in plan.block:
            if not _matches(block, key):
                raise RematUsageError(
                    f"remat_dist.shard_model: tp_plan.block key {key!r} names no "
                    f"submodule of block {name!r} ({type(block).__name__}); "
                    "parallelize_module would skip it with a warning and leave that "
                    "layer unsharded. Fix: use paths relative to the block."
                )
    block_names = [n for n, _ in selected]
    for key in plan.root:
        hits = _matches(model, key)
        if not hits:
            raise RematUsageError(
                f"remat_dist.shard_model: tp_plan.root key {key!r} names no submodule "
                f"of {type(model).__name__}."
            )
        for hit in hits:
            for b in block_names:
                if hit == b or strictly_inside(b, hit) or hit == "":
                    raise RematUsageError(
                        f"remat_dist.shard_model: tp_plan.root key {key!r} reaches "
                        f"{hit or 'the root'!r}, inside block {b!r} (or the root "
                        "itself). Fix: put per-block entries in "
                        "TensorParallelPlan.block, keys relative to the block."
                    )
    for name, block in selected:
        parallelize_module(block, tp_mesh, dict(plan.block))
        if plan.block_input == SEQUENCE:
            block.register_forward_pre_hook(
                _sequence_input_hook(tp_mesh, plan.sequence_dim, name)
            )
        if plan.block_output == SEQUENCE:
            block.register_forward_hook(
                _sequence_output_hook(tp_mesh, plan.sequence_dim)
            )
    if plan.root:
        parallelize_module(model, tp_mesh, dict(plan.root))
