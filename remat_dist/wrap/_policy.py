"""``apply_remat(policy=...)``: what each block's checkpoint keeps.

Kept apart from ``remat_dist.wrap._apply`` (which installs the checkpoints) so the
policy language, its validation and its error messages live in one place.

Policies
--------
``policy`` decides, per block, what the checkpoint keeps:

``"full"``
    recompute the whole block in backward (keep only its inputs).
``"none"``
    leave the block alone.
``{"attention": "save", ...}``
    checkpoint the block, but make each call of the named submodules (paths
    relative to the block) a region: ``"save"`` keeps that call's activations and
    skips it on replay (its outputs are persisted, since block code such as
    ``x + self.attention(h)`` reads them outside any region); ``"recompute"``
    reruns it (a named region in traces and reports). The region covers the whole
    module call, the submodule's own hooks included (tensor-parallel
    ``PrepareModuleInput`` on ``attention``, say), so a saved submodule's
    communication is not replayed either.
``{"every": k}`` or the int ``k``
    checkpoint only every k-th matched block, counting from the first one: blocks
    with index ``i % k == 0`` (so ``k=2`` checkpoints blocks 0, 2, 4, ...). A dict
    may combine ``"every"`` with submodule entries.
a callable ``(qualified_name, module) -> "full" | "none" | dict``
    decided per block (the dict must not contain ``"every"``).
``MemoryBudget(bytes=...)``
    decided by measurement: the first step profiles every block's candidates
    (full, each set of save regions, none) and the cheapest plan in recompute time
    that fits the budget on every rank is applied from the next step
    (``remat_dist.budget``, through ``_planned``; ``apply_remat`` hands it the
    blocks, never :func:`resolve_policy`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Union

from torch import nn

from remat_dist._errors import RematUsageError
from remat_dist.wrap._blocks import strictly_inside
from remat_dist.wrap._planned import PlannedPolicy

__all__ = ["REGION_MODES", "RematPolicy", "resolve_policy"]

REGION_MODES = ("save", "recompute")

RematPolicy = Union[
    str,
    int,
    Mapping[str, Any],
    Callable[[str, nn.Module], Union[str, Mapping[str, str]]],
    PlannedPolicy,
]
"""What ``policy=`` accepts (see the module docstring)."""


def resolve_policy(
    policy: RematPolicy, index: int, name: str, module: nn.Module
) -> dict[str, str] | None:
    """The region map for one block, or None to leave it alone."""
    where = f"remat_dist.apply_remat(policy=...) for block {name!r}"
    if isinstance(policy, PlannedPolicy):
        raise RematUsageError(
            f"{where}: a MemoryBudget decides for the whole model, not per block. "
            "Fix: pass it as apply_remat(model, blocks=..., policy=MemoryBudget(...)), "
            "not from a policy callable."
        )
    if isinstance(policy, bool):
        raise RematUsageError(f"{where}: policy must not be a bool, got {policy!r}.")
    if isinstance(policy, int):
        policy = {"every": policy}
    if isinstance(policy, str):
        if policy == "full":
            return {}
        if policy == "none":
            return None
        raise RematUsageError(
            f"{where}: unknown policy {policy!r}. Fix: use 'full', 'none', a dict "
            "such as {'attention': 'save'}, {'every': 2}, or a callable "
            "(qualified_name, module) -> 'full' | 'none' | dict."
        )
    if isinstance(policy, Mapping):
        regions = dict(policy)
        every = regions.pop("every", 1)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise RematUsageError(
                f"{where}: 'every' must be a positive int, got {every!r}."
            )
        if index % every:
            return None
        return _check_regions(regions, name, module)
    if callable(policy):
        decided = policy(name, module)
        if isinstance(decided, PlannedPolicy):
            return resolve_policy(decided, index, name, module)  # raises
        if isinstance(decided, Mapping) and "every" in decided:
            raise RematUsageError(
                f"{where}: the policy callable returned a dict with 'every'; a "
                "callable decides per block already. Fix: return 'none' for the "
                "blocks to skip."
            )
        if not isinstance(decided, (str, Mapping)):
            raise RematUsageError(
                f"{where}: the policy callable returned {decided!r}; expected 'full', "
                "'none' or a dict {submodule: 'save' | 'recompute'}."
            )
        return resolve_policy(decided, 0, name, module)
    raise RematUsageError(
        f"{where}: policy must be a str, an int, a dict or a callable, got "
        f"{type(policy).__name__}."
    )


def _check_regions(
    regions: dict[str, Any], name: str, block: nn.Module
) -> dict[str, str]:
    for path, mode in regions.items():
        if not isinstance(path, str) or not path:
            raise RematUsageError(
                f"remat_dist.apply_remat: policy keys are submodule paths relative to "
                f"the block, got {path!r} for block {name!r}."
            )
        if mode not in REGION_MODES:
            raise RematUsageError(
                f"remat_dist.apply_remat: policy[{path!r}] for block {name!r} is "
                f"{mode!r}; expected one of {REGION_MODES}."
            )
        try:
            block.get_submodule(path)
        except AttributeError:
            children = [n for n, _ in block.named_modules() if n]
            shown = ", ".join(children[:12]) + (", ..." if len(children) > 12 else "")
            raise RematUsageError(
                f"remat_dist.apply_remat: block {name!r} ({type(block).__name__}) has "
                f"no submodule {path!r} named in the policy. Its submodules: {shown}. "
                "Fix: use a path relative to the block, or a callable policy for "
                "blocks of different shapes."
            ) from None
    for outer, mode in regions.items():
        for inner, inner_mode in regions.items():
            if mode == "save" and strictly_inside(outer, inner):
                raise RematUsageError(
                    f"remat_dist.apply_remat: in block {name!r}, {inner!r} "
                    f"({inner_mode}) lies inside save region {outer!r}, whose body "
                    "is never replayed. Fix: drop the inner entry."
                )
    return dict(regions)
