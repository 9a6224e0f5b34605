"""Small public types shared by the core and everything built on it (a leaf module)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = ["CollectiveMode", "RecomputeStateHook", "SavedTensorInfo", "SavedTensorKind"]

CollectiveMode = Literal["replay", "save"]
"""``collectives=`` of a checkpoint or region: how the collectives it issues behave
on replay (``"replay"``: re-issued, each checked against the forward's before it is
issued; ``"save"``: their outputs kept, the replay issues none). The core carries
the value; the distributed layer gives it its meaning and validates it."""


@runtime_checkable
class RecomputeStateHook(Protocol):
    """State kept aligned between a checkpoint's forward and its replay.

    ``snapshot()`` is called at the checkpoint's entry and after every kept region
    on forward; ``restore(state)`` is called with the matching snapshot at the same
    points on replay, so code after a skipped region sees the state the forward saw
    (an RNG draw inside a skipped region does not shift later draws). The replay
    leaves the state as backward found it.

    Example::

        >>> class StepCounter(remat_dist.RecomputeStateHook):
        ...     def __init__(self, counter):
        ...         self.counter = counter
        ...     def snapshot(self):
        ...         return self.counter.value
        ...     def restore(self, state):
        ...         self.counter.value = state
        >>> run = remat_dist.checkpoint(
        ...     region_name="layers.0", recompute_state_hooks=(StepCounter(counter),)
        ... )(block)
    """

    def snapshot(self) -> Any: ...

    def restore(self, state: Any) -> None: ...


class SavedTensorKind(enum.Enum):
    """Why a tensor reaches a pack hook (see :func:`current_saved_tensor_info`).

    Members:
        CHECKPOINT_INPUT: an input a checkpoint keeps so that its replay can start.
        BACKWARD: a tensor an operator saves for backward in a kept region, or
            outside any checkpoint.
        SAVE_OUTPUT: a kept region's output kept for the replay
            (:func:`recompute_needs_tensor`).
    """

    CHECKPOINT_INPUT = "checkpoint_input"
    """A tensor argument of a checkpoint, kept so that replay can start."""
    BACKWARD = "backward"
    """A tensor an autograd node saves for backward (inside a save region or outside
    any checkpoint)."""
    SAVE_OUTPUT = "save_output"
    """A save region's output persisted because replay must feed it to later code."""


@dataclass(frozen=True)
class SavedTensorInfo:
    """What a pack hook is packing, and for which region.

    ``SavedTensorInfo(kind, context)`` is torch_remat's shape; remat_dist adds where
    the tensor comes from (``checkpoint``, ``region``, ``name``) as keyword fields.
    :func:`current_saved_tensor_info` returns one.

    Attributes:
        kind: why the tensor is packed (a :class:`SavedTensorKind`).
        context: what the hooks' ``capture_context()`` returned where the tensor was
            produced: in the kept region, at the save (``BACKWARD``) or when the
            region returned (``SAVE_OUTPUT``, even when a later consumer triggers the
            pack after the hooks' ``with`` block has exited). None without a
            ``capture_context``, for checkpoint inputs and for saves outside any
            checkpoint (as in torch_remat).
        checkpoint: the enclosing checkpoint's region name, or None outside one.
        region: the kept region's qualified name (``checkpoint::region``), or None.
        name: the ``save_for_backward`` name where one was given, else None.
    """

    kind: SavedTensorKind
    context: Any = None
    checkpoint: str | None = None
    region: str | None = None
    name: str | None = None
