"""When a backward through a model's output ends, and what that output holds: the
memory-budget planner installs its plan there (``remat_dist.budget._planner``).
Outputs are any pytree, dataclasses and mappings included (a ``ModelOutput``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from remat_dist._torch._autograd import queue_callback
from remat_dist._torch._pytree import tree_leaves

__all__ = ["at_end_of_backward", "input_shapes", "tensors_in"]


def input_shapes(args: Any) -> list[tuple[int, ...]]:
    """The shapes of the tensors in a forward's positional inputs."""
    return [tuple(t.shape) for t in tensors_in(args)]


def tensors_in(output: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors of a pytree, and of dataclasses and mappings that torch's pytree
    does not know (an unregistered ``ModelOutput``-like class)."""
    out = []
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif depth < 8 and dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            fields = [getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)]
            out.extend(tensors_in(fields, depth + 1))
        elif depth < 8 and isinstance(leaf, Mapping):
            out.extend(tensors_in(list(leaf.values()), depth + 1))
    return out


def at_end_of_backward(
    output: Any, fn: Callable[[], None], on_start: Callable[[], None] | None = None
) -> bool:
    """Run ``fn`` when the first backward through ``output`` ends, after everything
    else that backward queued (the step's end-of-backward report); False when no
    output tensor requires grad (no backward will run through it). ``output`` is
    any pytree: a tensor, a tuple, a dict, a dataclass such as a ``ModelOutput``."""
    tensors = [t for t in tensors_in(output) if t.requires_grad]
    if not tensors:
        return False
    queue = queue_callback
    fired = []

    def at_start(grad: torch.Tensor) -> None:
        if not fired:
            fired.append(True)
            if on_start is not None:
                on_start()
            # queued from a callback: runs after the callbacks queued during the
            # backward (the step's report), at the very end of the step
            queue(lambda: queue(fn))

    for t in tensors:  # whichever output the backward goes through
        t.register_hook(at_start)
    return True
