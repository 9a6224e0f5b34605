"""Storages behind tensors, and the walk over an autograd graph that finds saves.

A report counts bytes per *storage*: views share their base's storage and are
counted once. Tensor subclasses that wrap other tensors (``DTensor`` and other
traceable wrapper subclasses) own no storage themselves; their bytes are those of
the tensors they wrap (for a ``DTensor``: this rank's local shard).

The walk reads each node's saved tensors through ``node._raw_saved_<name>`` and
``SavedTensor.data``, which gives the packed object *without* unpacking it: calling
``node._saved_<name>`` on a node inside a checkpoint would start a recompute.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from remat_dist.core import (
    CheckpointRecord,
    PackedKind,
    classify_packed,
    records_of_node,
)

__all__ = [
    "GraphScan",
    "OutsideSave",
    "StorageKey",
    "is_parameter_tensor",
    "packed_tensors",
    "root_nodes",
    "scan_graph",
    "tensor_storages",
]

StorageKey = tuple[Any, int]

try:  # the packed stand-in of tensors torch's checkpoint will recompute
    from torch.utils.checkpoint import _Holder as _TorchHolder
except ImportError:  # pragma: no cover - older or newer torch
    _TorchHolder = None  # type: ignore[assignment,misc]


def _plain_tensors(t: torch.Tensor, depth: int = 0) -> Iterator[torch.Tensor]:
    if depth < 8 and is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        for attr in attrs:
            inner = getattr(t, attr, None)
            if isinstance(inner, torch.Tensor):
                yield from _plain_tensors(inner, depth + 1)
        return
    yield t


def tensor_storages(t: torch.Tensor) -> list[tuple[StorageKey, int, torch.Tensor]]:
    """``(storage key, storage bytes, plain tensor)`` for the storages behind ``t``.

    One entry for a plain tensor; for a wrapper subclass, one per wrapped tensor
    (a ``DTensor`` gives its local shard). Tensors without real storage (meta,
    fake, placeholders) give none.
    """
    out = []
    for p in _plain_tensors(t):
        if p.device.type == "meta":
            continue
        try:
            storage = p.untyped_storage()
            # keyed by the storage object (see remat_dist.core._record.storage_key)
            out.append(((p.device, storage._cdata), storage.nbytes(), p))
        except (RuntimeError, NotImplementedError, TypeError):
            continue
    return out


def is_parameter_tensor(t: torch.Tensor) -> bool:
    """``t`` is an ``nn.Parameter`` or a view of one."""
    seen = 0
    while t is not None and seen < 16:
        if isinstance(t, torch.nn.Parameter):
            return True
        t = t._base  # type: ignore[assignment]
        seen += 1
    return False


def packed_tensors(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """Tensors inside whatever a pack hook returned (tuples, lists, dicts, and the
    attributes of small objects), so that their bytes can be counted."""
    if depth > 4 or obj is None:
        return []
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (str, bytes, int, float, bool, torch.dtype, torch.device)):
        return []
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in packed_tensors(x, depth + 1)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in packed_tensors(x, depth + 1)]
    if isinstance(obj, torch.nn.Module) or callable(obj):
        return []
    values: list[Any] = []
    for slot in getattr(type(obj), "__slots__", ()):
        values.append(getattr(obj, slot, None))
    values.extend(getattr(obj, "__dict__", {}).values())
    return [t for x in values for t in packed_tensors(x, depth + 1)]


@dataclass
class OutsideSave:
    """One tensor saved by a graph node outside every checkpoint."""

    node_type: str
    node_index: int
    tensor: torch.Tensor
    user_hook: bool


@dataclass
class GraphScan:
    """What one walk over the graph reachable from some roots found."""

    records: list[CheckpointRecord] = field(default_factory=list)
    """Reachable checkpoint records, in forward order."""
    outside: list[OutsideSave] = field(default_factory=list)
    region_tensors: list[tuple[torch.Tensor, str]] = field(default_factory=list)
    """Tensors held by save-region saves (kept and user-packed) on the graph,
    each with ``NodeType.saved_name`` of the node that saved it."""
    parameter_keys: set[StorageKey] = field(default_factory=set)
    nodes: int = 0
    recompute_handles: int = 0
    scopes: dict[int, Any] = field(default_factory=dict)
    """``gradient_checkpoint_scope`` records whose recompute handles are on the
    graph (their tensors are recomputed: only the scope's own state is kept)."""


def root_nodes(roots: Iterable[Any]) -> list[Any]:
    """Autograd nodes for ``roots``: tensors (their ``grad_fn``), nodes, and
    (nested) lists, tuples and dicts of them."""
    nodes: list[Any] = []

    def visit(x: Any) -> None:
        if x is None:
            return
        if isinstance(x, torch.Tensor):
            if x.grad_fn is not None:
                nodes.append(x.grad_fn)
        elif isinstance(x, torch.autograd.graph.Node):
            nodes.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)
        else:
            raise TypeError(
                "remat_dist reports take tensors, autograd nodes, or lists/tuples/"
                f"dicts of them as roots; got {type(x).__name__}"
            )

    for r in roots:
        visit(r)
    return nodes


_saved_attrs_cache: dict[type, tuple[str, ...]] = {}


def _saved_attrs(node: Any) -> tuple[str, ...]:
    cls = type(node)
    attrs = _saved_attrs_cache.get(cls)
    if attrs is None:
        attrs = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
        _saved_attrs_cache[cls] = attrs
    return attrs


def _saved_objects(node: Any) -> Iterator[tuple[str, Any]]:
    """``(saved name, packed object)`` for each tensor ``node`` saved."""
    for attr in _saved_attrs(node):
        try:
            value = getattr(node, attr)
        except RuntimeError:  # freed by a backward that already ran
            continue
        name = attr[len("_raw_saved_") :]
        many = isinstance(value, (list, tuple))
        for i, saved in enumerate(value if many else (value,)):
            try:
                data = saved.data
            except (RuntimeError, AttributeError):
                continue
            if data is not None:
                yield (f"{name}[{i}]" if many else name), data


def _sequence_nr(node: Any) -> int:
    try:
        return int(node._sequence_nr())
    except (AttributeError, RuntimeError):
        return 0


def scan_graph(roots: Iterable[Any]) -> GraphScan:
    """Walk every node reachable from ``roots`` once and sort what it saves.

    Plain tensors (and objects a user pack hook made) saved by nodes outside every
    checkpoint become :class:`OutsideSave` s; stand-ins of tensors the checkpoint
    will recompute cost nothing; save-region saves are collected for the records
    to attribute. ``AccumulateGrad`` nodes of ``nn.Parameter`` s give the storages
    that reports treat as parameters. Cost: one visit per node and saved tensor.
    """
    scan = GraphScan()
    stack = root_nodes(roots)
    seen: set[int] = set()
    keep_alive: list[Any] = []
    found: dict[int, tuple[int, CheckpointRecord]] = {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        keep_alive.append(node)
        index = scan.nodes
        scan.nodes += 1
        for record in records_of_node(node):
            seq = _sequence_nr(node)
            prev = found.get(id(record))
            if prev is None or seq < prev[0]:
                found[id(record)] = (seq, record)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            if isinstance(variable, torch.nn.Parameter):
                for key, _, _ in tensor_storages(variable):
                    scan.parameter_keys.add(key)
        node_type = type(node).__name__
        for saved_name, data in _saved_objects(node):
            if isinstance(data, torch.Tensor):
                scan.outside.append(OutsideSave(node_type, index, data, False))
            elif _TorchHolder is not None and isinstance(data, _TorchHolder):
                scan.recompute_handles += 1
            elif (packed := classify_packed(data)) is None:
                for t in packed_tensors(data):
                    scan.outside.append(OutsideSave(node_type, index, t, True))
            else:
                kind, payload = packed
                label = f"{node_type}.{saved_name}"
                if kind is PackedKind.SCOPE_HANDLE:
                    scan.recompute_handles += 1
                    scan.scopes.setdefault(id(payload), payload)
                elif kind is PackedKind.REGION_KEPT:
                    scan.region_tensors.append((payload, label))
                else:
                    for t in packed_tensors(payload):
                        scan.region_tensors.append((t, label))
        for next_node, _ in getattr(node, "next_functions", ()):
            if next_node is not None and id(next_node) not in seen:
                stack.append(next_node)
    scan.records = [rec for _, rec in sorted(found.values(), key=lambda x: x[0])]
    return scan
