"""What ``apply_remat`` refuses before it changes anything: blocks already
checkpointed, nested blocks, containers with no forward of their own, torch's
``CheckpointWrapper`` inside a block, FSDP units inside a block."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from remat_dist._errors import RematUsageError
from remat_dist._torch._checkpoint import checkpoint_wrapper_types
from remat_dist.wrap._blocks import strictly_inside
from remat_dist.wrap._patch import BLOCK_ATTR

__all__ = ["check_blocks", "check_no_fsdp_inside"]


def check_blocks(model: nn.Module, selected: Sequence[tuple[str, nn.Module]]) -> None:
    """Raise :class:`RematUsageError` naming the block and the fix when a selected
    block cannot be checkpointed as it is."""
    all_named = list(model.named_modules())
    already = [n for n, m in all_named if BLOCK_ATTR in m.__dict__]
    selected_names = [n for n, _ in selected]
    for name, module in selected:
        if BLOCK_ATTR in module.__dict__:
            raise RematUsageError(
                f"remat_dist.apply_remat: block {name!r} is already checkpointed by an "
                "earlier apply_remat call. Fix: apply it once, or call "
                "remat_dist.remove_remat(model) first to change the policy."
            )
        for other in already + selected_names:
            if strictly_inside(name, other):
                outer, inner = name, other
            elif strictly_inside(other, name):
                outer, inner = other, name
            else:
                continue
            raise RematUsageError(
                f"remat_dist.apply_remat: block {inner!r} lies inside block "
                f"{outer!r}, and both would be checkpointed; nested checkpoints "
                "are not supported. Fix: select one level of blocks, or keep the "
                "inner one as a policy entry ({'sub': 'save'})."
            )
    for name, module in selected:
        if (
            type(module).forward is nn.Module.forward
            and "forward" not in module.__dict__
        ):
            raise RematUsageError(
                f"remat_dist.apply_remat: block {name!r} ({type(module).__name__}) has "
                "no forward of its own (a container such as ModuleList is iterated, "
                "never called), so a checkpoint around it would never run. Fix: "
                "select the blocks inside it, e.g. blocks=Block."
            )
    wrappers = _nested_checkpoint_types()
    if wrappers:
        for name, module in selected:
            for sub_name, sub in module.named_modules():
                if isinstance(sub, wrappers):
                    where = f"{name}.{sub_name}" if sub_name else name
                    raise RematUsageError(
                        f"remat_dist.apply_remat: block {name!r} contains a torch "
                        f"CheckpointWrapper at {where!r}; nested checkpoints are not "
                        "supported. Fix: remove torch's checkpoint_wrapper and let "
                        "apply_remat checkpoint the block."
                    )
    fsdp_type = _fsdp_module_type()
    if fsdp_type is not None:
        units = [n for n, m in all_named if n and isinstance(m, fsdp_type)]
        check_no_fsdp_inside(
            selected_names,
            units,
            fix="pass the same blocks to apply_remat as to shard_model/fully_shard.",
        )



_nested_checkpoint_types = checkpoint_wrapper_types


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # pragma: no cover - very old torch
        return None
    return FSDPModule


def check_no_fsdp_inside(
    checkpointed: Sequence[str],
    fsdp_units: Sequence[str],
    *,
    fix: str,
) -> None:
    """Refuse checkpointed blocks that strictly contain FSDP units."""
    for outer in checkpointed:
        for inner in fsdp_units:
            if strictly_inside(outer, inner):
                raise RematUsageError(
                    f"remat_dist: checkpointed block {outer!r} contains the FSDP unit "
                    f"{inner!r}: its parameter all-gathers would run inside the "
                    "checkpoint and again on replay. Checkpoint the FSDP units (or "
                    f"modules inside them) instead. Fix: {fix}"
                )
