"""Storages behind tensors, and the walk over an autograd graph that finds saves.

A report counts bytes per *storage*: views share their base's storage and are
counted once. Tensor subclasses that wrap other tensors (``DTensor`` and other
traceable wrapper subclasses) own no storage themselves; their bytes are those of
the tensors they wrap (for a ``DTensor``: this rank's local shard).

The walk reads each node's saved tensors through ``node._raw_saved_<name>`` and
``SavedTensor.data``, which gives the packed object *without* unpacking it: calling
``node._saved_<name>`` on a node inside a checkpoint would start a recompute.

``torch.utils.checkpoint`` (non-reentrant, also under ``checkpoint_wrapper``) packs
every save of its forward into a ``_Holder`` (a recompute handle: nothing kept) and
keeps its inputs on its ``_CheckpointFrame`` (``frame_saved_inputs``), which only the unpack
hook of those saves refers to. The walk finds each frame through
``SavedTensor.unpack_hook`` of a holder and reports it as a
:class:`TorchCheckpointFrame`: what torch keeps for backward are its inputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from remat_dist._state import register_state
from remat_dist._torch import _autograd
from remat_dist._torch._checkpoint import (
    CheckpointFrame,
    Holder,
    frame_function,
    frame_saved_inputs,
)
from remat_dist._torch._pytree import tree_leaves
from remat_dist._torch._tensor import TorchDispatchMode, is_traceable_wrapper_subclass
from remat_dist.core import (
    CheckpointRecord,
    PackedKind,
    classify_packed,
    positional_name,
    records_of_node,
)

__all__ = [
    "GraphScan",
    "OutsideSave",
    "TorchCheckpointFrame",
    "running_torch_checkpoint",
    "StorageKey",
    "is_parameter_tensor",
    "packed_tensors",
    "root_nodes",
    "scan_graph",
    "tensor_storages",
]

StorageKey = tuple[Any, int]

_TorchHolder: Any = Holder  # the stand-in of a tensor torch's checkpoint recomputes
_TorchFrame: Any = CheckpointFrame  # what torch's checkpoint keeps per call


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
    record_seqs: list[int] = field(default_factory=list)
    """Forward position (lowest ``_sequence_nr``) of each of :attr:`records`."""
    torch_frames: list[TorchCheckpointFrame] = field(default_factory=list)
    """``torch.utils.checkpoint`` calls whose handles are on the graph, in forward
    order (their handles are also in :attr:`recompute_handles`)."""


@dataclass
class TorchCheckpointFrame:
    """One ``torch.utils.checkpoint`` call (non-reentrant) found on the graph.

    Its forward's saves are recompute handles (they cost nothing until backward);
    what it keeps are its inputs, on the frame, so that recompute can start.
    """

    frame: Any
    seq: int
    """Lowest ``_sequence_nr`` of the nodes holding its handles (forward order)."""
    recompute_handles: int = 0

    def inputs(self) -> list[tuple[int, torch.Tensor, bool]]:
        """``(argument index, tensor, packed by a user hook)`` for what the frame
        keeps of its tensor inputs. Inputs packed by an enclosing checkpoint into a
        recompute stand-in (torch's holder, a scope handle) cost nothing here."""
        out: list[tuple[int, torch.Tensor, bool]] = []
        for i, arg in frame_saved_inputs(self.frame):
            try:
                data = arg.data
            except (RuntimeError, AttributeError):
                continue
            if data is None or (_TorchHolder is not None and isinstance(data, _TorchHolder)):
                continue
            if isinstance(data, torch.Tensor):
                out.append((i, data, False))
                continue
            packed = classify_packed(data)
            if packed is None:
                out.extend((i, t, True) for t in packed_tensors(data))
            elif packed[0] is PackedKind.REGION_KEPT:
                out.append((i, packed[1], False))
            elif packed[0] is PackedKind.REGION_USER_PACKED:
                out.extend((i, t, True) for t in packed_tensors(packed[1]))
        return out

    def input_name(self, index: int) -> str:
        """What reports call argument ``index``: the parameter of the checkpointed
        function it binds to (``input {index}`` where none names it)."""
        return positional_name(frame_function(self.frame), index)

    def cached(self) -> list[torch.Tensor]:
        """The op outputs torch's selective checkpointing cached for backward (its
        ``MUST_SAVE`` / ``PREFER_SAVE`` ops: ``create_selective_checkpoint_contexts``,
        torchtitan's selective "op" AC), found in the cache its recompute context
        reads; empty for a plain checkpoint. Entries backward already consumed are
        gone from the cache and not counted."""
        out: list[torch.Tensor] = []
        for cache in _caches_in(getattr(self.frame, "recompute_fn", None)):
            for leaf in tree_leaves(list(cache.values())):
                t = getattr(leaf, "val", None)  # torch's version-checking wrapper
                if isinstance(t, torch.Tensor):
                    out.append(t)
        return out


def _caches_in(fn: Any) -> list[dict[Any, Any]]:
    """The ``storage`` dicts of the dispatch modes ``fn`` closes over (directly,
    in a tuple, or through a function it closes over), each once."""
    found: dict[int, dict[Any, Any]] = {}
    todo, depth = [fn], 0
    while todo and depth < 3:
        nxt = []
        for obj in todo:
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    value = cell.cell_contents
                except ValueError:
                    continue
                for v in value if isinstance(value, tuple) else (value,):
                    storage = getattr(v, "storage", None)
                    if isinstance(v, TorchDispatchMode) and isinstance(storage, dict):
                        found[id(storage)] = storage
                if callable(value) and getattr(value, "__closure__", None):
                    nxt.append(value)
        todo, depth = nxt, depth + 1
    return list(found.values())


def _torch_frame_of(saved: Any) -> Any:
    """The ``_CheckpointFrame`` whose unpack hook ``saved`` (a ``SavedTensor``
    holding a torch ``_Holder``) carries, found in the hook's closure; or None."""
    if _TorchFrame is None:
        return None
    try:
        hook = saved.unpack_hook
    except (RuntimeError, AttributeError):
        return None
    todo, depth = [hook], 0
    while todo and depth < 3:
        nxt = []
        for fn in todo:
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    value = cell.cell_contents
                except ValueError:
                    continue
                if isinstance(value, _TorchFrame):
                    return value
                if callable(value) and getattr(value, "__closure__", None):
                    nxt.append(value)
        todo, depth = nxt, depth + 1
    return None


def running_torch_checkpoint() -> TorchCheckpointFrame | None:
    """The ``torch.utils.checkpoint`` whose forward is running here, if torch's
    checkpoint hook is the innermost saved-tensors hook (read from the pack hook's
    closure); None otherwise, and for the frames ``remat_dist.checkpoint`` runs on.
    ``recompute_handles`` is the number of its forward's saves so far."""
    try:
        top = _autograd.top_saved_tensors_hooks(False)
    except (AttributeError, RuntimeError, TypeError):  # pragma: no cover - other torch
        return None
    if not top:
        return None
    frame = None
    for cell in getattr(top[0], "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if _TorchFrame is not None and isinstance(value, _TorchFrame):
            frame = value
    if frame is None or _is_remat_frame(frame):
        return None
    handles = sum(1 for ref in frame.weak_holders if ref() is not None)
    return TorchCheckpointFrame(frame, 0, handles)


def _is_remat_frame(frame: Any) -> bool:
    """``remat_dist.checkpoint`` runs on torch's checkpoint: its frame's recompute
    function closes over the replay context, which carries the
    :class:`CheckpointRecord` (that record reports the checkpoint, inputs included)."""
    fn = getattr(frame, "recompute_fn", None)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(getattr(value, "record", None), CheckpointRecord):
            return True
    return False


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


class _SavedAttrs(dict[type, tuple[str, ...]]):
    """Per node class, the names of its saved-tensor attributes (a cache)."""

    def reset(self) -> None:
        self.clear()


_saved_attrs_cache = register_state("report.saved_attrs", _SavedAttrs())


def _saved_attrs(node: Any) -> tuple[str, ...]:
    cls = type(node)
    attrs = _saved_attrs_cache.get(cls)
    if attrs is None:
        attrs = tuple(a for a in dir(node) if a.startswith(_autograd.RAW_SAVED_PREFIX))
        _saved_attrs_cache[cls] = attrs
    return attrs


def _saved_objects(node: Any) -> Iterator[tuple[str, Any, Any]]:
    """``(saved name, SavedTensor, packed object)`` for each tensor ``node`` saved."""
    for attr in _saved_attrs(node):
        try:
            value = getattr(node, attr)
        except RuntimeError:  # freed by a backward that already ran
            continue
        name = attr[len(_autograd.RAW_SAVED_PREFIX) :]
        many = isinstance(value, (list, tuple))
        for i, saved in enumerate(value if many else (value,)):
            try:
                data = saved.data
            except (RuntimeError, AttributeError):
                continue
            if data is not None:
                yield (f"{name}[{i}]" if many else name), saved, data


_sequence_nr = _autograd.node_sequence_nr


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
    frames: dict[int, TorchCheckpointFrame] = {}
    remat_frames: set[int] = set()
    frames_alive: list[Any] = []  # keeps ids unique while the walk runs
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
        for saved_name, saved, data in _saved_objects(node):
            if isinstance(data, torch.Tensor):
                scan.outside.append(OutsideSave(node_type, index, data, False))
            elif _TorchHolder is not None and isinstance(data, _TorchHolder):
                scan.recompute_handles += 1
                frame = _torch_frame_of(saved)
                frames_alive.append(frame)
                if frame is not None and id(frame) not in remat_frames:
                    seq = _sequence_nr(node)
                    tf = frames.get(id(frame))
                    if tf is None:
                        if _is_remat_frame(frame):
                            remat_frames.add(id(frame))
                            continue
                        tf = frames[id(frame)] = TorchCheckpointFrame(frame, seq)
                    tf.seq = min(tf.seq, seq)
                    tf.recompute_handles += 1
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
    ordered = sorted(found.values(), key=lambda x: x[0])
    scan.records = [rec for _, rec in ordered]
    scan.record_seqs = [seq for seq, _ in ordered]
    scan.torch_frames = sorted(frames.values(), key=lambda f: f.seq)
    return scan
