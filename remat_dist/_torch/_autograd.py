"""The autograd engine's private pieces: the saved-tensor default hooks stack (the
C++ stack ``torch.autograd.graph.saved_tensors_hooks`` pushes onto), the graph task
running on this thread (its id, whether it keeps its graph, the node it runs and
the nodes it will run), callbacks queued to the end of a backward, and a graph
node's sequence number and saved tensors."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "RAW_SAVED_PREFIX",
    "current_graph_task_id",
    "current_node",
    "graph_task_keeps_graph",
    "node_sequence",
    "node_sequence_nr",
    "pop_saved_tensors_hooks",
    "push_saved_tensors_hooks",
    "queue_callback",
    "raw_saved_names",
    "saved_tensors_hooks_disable",
    "saved_tensors_hooks_disabled_message",
    "saved_tensors_hooks_enable",
    "saved_tensors_hooks_enabled",
    "sequence_counter",
    "top_saved_tensors_hooks",
    "will_execute_node",
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

current_node: Callable[[], Any] = torch._C._current_autograd_node
"""The graph node the engine is running on this thread (None when none is): inside
a saved tensor's unpack during backward, the node that unpacks it."""

will_execute_node: Callable[[Any], bool] = torch._C._will_engine_execute_node
"""``will_execute_node(node)``, inside a backward: whether the running graph task
reaches ``node`` from its roots and, for ``autograd.grad`` or ``inputs=``, needs
it. Two quirks of torch 2.13: the root of a task started from one edge is not
among the nodes it reaches (False, though it runs first), and a node whose
gradient ``autograd.grad`` captures without running it gives True (a leaf that is
captured raises ``RuntimeError`` instead)."""

sequence_counter: Callable[[], int] = _ag._get_sequence_nr
"""The sequence number the next graph node made on this thread gets: the nodes a
piece of code made on this thread have the numbers between two reads around it."""

queue_callback: Callable[[Callable[[], None]], None] = (
    torch.autograd.Variable._execution_engine.queue_callback
)
"""Run a function when the running backward ends (only inside a backward)."""

RAW_SAVED_PREFIX = "_raw_saved_"
"""A graph node's saved tensors are its attributes of this prefix (the
``SavedTensor`` objects, read without unpacking them)."""


node_sequence: Callable[[Any], int] = operator.methodcaller("_sequence_nr")
"""The sequence number of a graph node (``AccumulateGrad``: the largest 64-bit
value); raises on an object that is not a node."""


def raw_saved_names(node_type: type) -> tuple[str, ...]:
    """The attributes of ``node_type``'s nodes that give their saved tensors as
    ``SavedTensor`` s (a tuple of them for a custom ``autograd.Function``), whose
    ``data`` is what the pack hook returned, without unpacking them. Reading one
    after a backward freed it raises ``RuntimeError``."""
    return tuple(a for a in dir(node_type) if a.startswith(RAW_SAVED_PREFIX))


def node_sequence_nr(node: Any) -> int:
    """The sequence number of a graph node (0 where it has none)."""
    try:
        return int(node._sequence_nr())
    except (AttributeError, RuntimeError):
        return 0
