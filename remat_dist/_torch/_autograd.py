"""The autograd engine's private pieces: the saved-tensor default hooks stack (the
C++ stack ``torch.autograd.graph.saved_tensors_hooks`` pushes onto), the graph task
running on this thread, callbacks queued to the end of a backward, and what a graph
node saved."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "RAW_SAVED_PREFIX",
    "current_graph_task_id",
    "graph_task_keeps_graph",
    "node_sequence_nr",
    "pop_saved_tensors_hooks",
    "push_saved_tensors_hooks",
    "queue_callback",
    "saved_tensors_hooks_disable",
    "saved_tensors_hooks_disabled_message",
    "saved_tensors_hooks_enable",
    "saved_tensors_hooks_enabled",
    "top_saved_tensors_hooks",
]

_ag = torch._C._autograd

top_saved_tensors_hooks: Callable[[bool], tuple[Any, Any] | None] = (
    _ag._top_saved_tensors_default_hooks
)
"""``top_saved_tensors_hooks(ignore_is_tracing)``: the innermost ``(pack, unpack)``
pair of this thread's saved-tensor hooks stack, or None."""
push_saved_tensors_hooks: Callable[[Any, Any], None] = (
    _ag._push_saved_tensors_default_hooks
)
"""``push_saved_tensors_hooks(pack, unpack)``: push a pair onto the stack."""
pop_saved_tensors_hooks: Callable[[], None] = _ag._pop_saved_tensors_default_hooks
"""Pop the innermost pair of the stack."""
saved_tensors_hooks_enabled: Callable[[], bool] = _ag._saved_tensors_hooks_is_enabled
"""Whether saved-tensor hooks may be pushed on this thread."""
saved_tensors_hooks_enable: Callable[[], None] = _ag._saved_tensors_hooks_enable
"""Allow saved-tensor hooks on this thread again."""
saved_tensors_hooks_disable: Callable[[str], None] = _ag._saved_tensors_hooks_disable
"""``saved_tensors_hooks_disable(message)``: refuse hooks, raising ``message``."""
saved_tensors_hooks_disabled_message: Callable[[], str | None] = (
    _ag._saved_tensors_hooks_get_disabled_error_message
)
"""The message hooks are refused with on this thread (None: they are allowed)."""

current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
"""The id of the backward graph task running on this thread (-1 outside backward)."""

graph_task_keeps_graph: Callable[[], bool] = _ag._get_current_graph_task_keep_graph
"""Whether the backward running on this thread keeps its graph (``retain_graph``);
True outside backward."""

queue_callback: Callable[[Callable[[], None]], None] = (
    torch.autograd.Variable._execution_engine.queue_callback
)
"""Run a function when the running backward ends (only inside a backward)."""

RAW_SAVED_PREFIX = "_raw_saved_"
"""A graph node's saved tensors are its attributes of this prefix (the
``SavedTensor`` objects, read without unpacking them)."""


def node_sequence_nr(node: Any) -> int:
    """The sequence number of a graph node (0 where it has none)."""
    try:
        return int(node._sequence_nr())
    except (AttributeError, RuntimeError):
        return 0
