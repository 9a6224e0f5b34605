"""The save region's side of a checkpoint: its saved-tensor hooks and its outputs.

On forward a save region (``region(fn, name, recompute=False)``) runs under the
hooks of :func:`_save_region_hooks`: what it saves stays on the original graph
(:class:`~remat_dist.core._packed._Kept` or user-packed), except views of its own
inputs that replay recomputes anyway, which are routed to torch's checkpoint hook
(:class:`_RegionInputs`) and re-emitted when replay skips the region
(:func:`_emit_routed`). Its outputs are recorded (:func:`_record_outputs`) and
persisted only where code that replay runs consumes them
(:func:`_persist_if_produced`); everything else is served as placeholders.

When the persisted outputs go: each replay reads them, and only the replay in the
last backward that can replay the checkpoint may drop them (:func:`replay_frees_graph`
says whether it is that one; ``_region._serve`` drops each as it serves it, the
replay's end the ones it did not reach).

torch's checkpoint replays once per graph task that unpacks one of its saved
tensors (the ``_Holder`` s its pack hook made), and a backward that does not keep
its graph frees a node's saved tensors right after running that node. So a later
backward can replay a checkpoint exactly as long as one of its holders is alive,
and a holder dies in one of two ways: a backward with ``retain_graph=False`` runs
its node, or the graph dies (torch's checkpoint frame, which holds the inputs,
goes with the last holder). The last backward is therefore the one that keeps no
graph *and* will run every node still holding one of the checkpoint's holders.

A plain ``loss.backward()`` is such a backward. Split backward is not (zero-bubble
pipeline schedules: ``stage_backward_input`` keeps the graph; then
``stage_backward_weight`` runs one ``autograd.grad`` per parameter group, each
running only the nodes between that group's intermediates and its parameters, and
replaying again): no weight pass runs the nodes that lead only to the stage's
inputs (an RMSNorm's ``pow``), so their holders, torch's frame and the persisted
outputs all live until the graph dies after the last weight pass (the record, which
holds them, is owned by the graph and dies with it: the same event).

How a replay knows, at its start (inside torch's unpack of the holder that started
it): the node being run (``current_node``; it runs, so its holders go) and every
node of the checkpoint below its outputs (from the outputs' nodes, which carry a
:class:`_Below` in their metadata, and within the sequence numbers its forward's
nodes got) are searched for the frame's live holders, and each node holding one
must be the running node or one the engine will run in this task
(``will_execute_node``, for it and one of its children: torch also says True for a
node whose gradient ``autograd.grad`` only captures). A live holder not found (an
output's own node that is not the one running, an output's node already gone, a
node reachable from elsewhere only) means "not the last". A wrong "no" only keeps
the outputs until the graph dies; a wrong "yes" would make a later replay raise.

The search costs one visit per node of the checkpoint, and runs only for a replay
in a backward that keeps no graph, of a checkpoint that persisted an output.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from remat_dist._errors import RematError
from remat_dist._state import register_state
from remat_dist._torch import _autograd
from remat_dist._torch._checkpoint import live_holders, replay_target
from remat_dist._torch._pytree import tree_leaves
from remat_dist.core import _standin
from remat_dist.core._arg_names import leaf_names
from remat_dist.core._hooks import for_user_hook, innermost_hooks, saved_name
from remat_dist.core._packed import _Kept, _UserPacked
from remat_dist.core._record import (
    CheckpointRecord,
    PersistedOutput,
    RegionRecord,
    saved_entry,
)
from remat_dist.core._storage import storage_key, storage_nbytes, tensor_meta
from remat_dist.core._types import SavedTensorInfo, SavedTensorKind

_top_hooks = _autograd.top_saved_tensors_hooks


def _checkpoint_hooks_below() -> tuple[Any, Any] | None:
    """torch's checkpoint pack/unpack hooks, when they are the innermost ones."""
    hooks = _top_hooks(False)
    if hooks is None:
        return None
    if not (
        getattr(hooks[0], "__qualname__", "").startswith("_checkpoint_hook.")
        or _standin.is_tracker(hooks[0])
    ):
        return None  # another hook sits in between: keep everything
    return hooks


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Storage element range ``[first, last]`` that ``t`` covers."""
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.storage_offset(), last


def _same_layout(a: torch.Tensor, t: torch.Tensor) -> bool:
    """``t`` addresses exactly ``a``'s elements, as ``a`` does."""
    return (
        a.shape == t.shape
        and a.stride() == t.stride()
        and a.storage_offset() == t.storage_offset()
    )


def _dense(a: torch.Tensor) -> bool:
    """``a``'s elements fill its storage extent with no gap and no overlap (it is
    contiguous up to a permutation of its dims, e.g. ``w.t()``): every tensor within
    that extent is made of ``a``'s elements only."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(a.shape, a.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class _RegionInputs:
    """The region's plain-tensor arguments that replay recomputes, by storage."""

    def __init__(self, record: CheckpointRecord, args: tuple[Any, ...], kwargs: dict):
        self.by_storage: dict[Any, list[tuple[int, torch.Tensor, int]]] = {}
        for i, a in enumerate(tree_leaves((args, kwargs))):
            if type(a) is not torch.Tensor or a.numel() == 0:
                continue
            key = storage_key(a)
            if record.producer_of(key) is not None:
                continue  # a skipped save region's output: replay may not have it
            self.by_storage.setdefault(key, []).append((i, a, a._version))

    def clear(self) -> None:
        """Drop the references to the inputs (the pack hook outlives the region)."""
        self.by_storage.clear()

    def find(self, t: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """``(flat index, input)`` of the unchanged input ``t`` lies within."""
        if type(t) is not torch.Tensor or t.numel() == 0:
            return None
        first, last = _extent(t)
        for i, a, version in self.by_storage.get(storage_key(t), ()):
            lo, hi = _extent(a)
            if t._version != version:
                return None  # changed in place inside the region: replay would not
            if a.dtype != t.dtype:
                continue
            if _same_layout(a, t) or (_dense(a) and lo <= first and last <= hi):
                return i, a
        return None


def _save_region_hooks(
    record: CheckpointRecord, rr: RegionRecord, inputs: _RegionInputs
) -> torch.autograd.graph.saved_tensors_hooks:
    """The hooks a save region runs under on forward: keep each save on the graph
    (under the user's hooks when there are any), routing recomputable inputs to
    torch's checkpoint hook."""
    user = innermost_hooks()
    below = _checkpoint_hooks_below()

    def pack(t: torch.Tensor) -> Any:
        if below is not None:
            hit = inputs.find(t)
            if hit is not None:
                # A (view of a) region input that replay recomputes anyway: let
                # torch's checkpoint recompute it instead of keeping it. On replay
                # the skipped region emits the same pack (see _emit_routed).
                i, a = hit
                rr.routed.append(
                    (i, tuple(a.shape), a.stride(), tuple(t.shape), t.stride(),
                     t.storage_offset() - a.storage_offset())
                )
                return below[0](t)
        name = saved_name(t)
        entry = saved_entry(t, name)
        entry.packed_by_user_hook = user is not None
        rr.saved.append(entry)
        if user is None:
            # detach: a tensor that is the op's own output would otherwise hold its
            # grad_fn, a reference cycle through the saved variable.
            return _Kept(t.detach(), t._version)
        info = SavedTensorInfo(
            SavedTensorKind.BACKWARD,
            user.capture(),
            checkpoint=record.name,
            region=rr.name,
            name=name,
        )
        return _UserPacked(user, user.pack_with(for_user_hook(t), info))

    def unpack(p: Any) -> torch.Tensor:
        if isinstance(p, _UserPacked):
            return p.hooks.unpack_with(p.packed)
        if not isinstance(p, _Kept):
            return below[1](p)  # routed to torch's checkpoint: recomputed
        t = p.tensor
        if t._version != p.version:
            # autograd skips its own version check for hooked saves; do it here.
            raise RematError(
                "one of the variables needed for gradient computation has been "
                f"modified by an inplace operation: [{t.dtype}, {tuple(t.shape)}], "
                f"saved by save region {rr.name!r} (checkpoint {record.name!r}), is at "
                f"version {t._version}; expected version {p.version} instead. Fix: "
                "clone the tensor before modifying it in place."
            )
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _emit_routed(
    record: CheckpointRecord,
    rr: RegionRecord,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict,
) -> None:
    """On replay, where a save region is skipped: hand torch's recompute hook the
    region inputs that the forward routed to it, in the same order, rebuilt from
    this replay's (recomputed) arguments (``fn``: the region's function, which
    names them in an error)."""
    hooks = _top_hooks(False)
    flat = tree_leaves((args, kwargs))
    with torch.no_grad():
        for i, a_shape, a_stride, shape, stride, rel in rr.routed:
            a = flat[i] if i < len(flat) else None
            if (
                hooks is None
                or not isinstance(a, torch.Tensor)
                or tuple(a.shape) != a_shape
                or a.stride() != a_stride
            ):
                got = (
                    (tuple(a.shape), a.stride())
                    if isinstance(a, torch.Tensor)
                    else type(a).__name__
                )
                names = leaf_names(fn, args, kwargs)
                what = names[i] if i < len(names) else f"input {i}"
                raise RematError(
                    f"remat_dist: save region {rr.name!r} (recompute=False) saved a "
                    "view of an input for backward, but recompute reproduced that input "
                    f"with a different layout ({what}: expected shape {a_shape} "
                    f"strides {a_stride}, got {got}). The replay of checkpoint "
                    f"{record.name!r} reached save region {rr.name!r} with other inputs "
                    "than the forward. Fix: compute the region's inputs the same way on "
                    "replay (branch on remat_dist.is_recomputing() only where layouts "
                    "stay the same), or pass .contiguous() inputs to the region."
                )
            hooks[0](a.as_strided(shape, stride, a.storage_offset() + rel))


def _record_outputs(
    record: CheckpointRecord, rr: RegionRecord, items: list[Any], structure: Any
) -> None:
    """Note a save region's outputs; persist for free those backward keeps anyway,
    and index the rest by storage so that later consumers can persist them."""
    rr.output_structure = structure
    rr.outputs = items
    rr.output_hooks = innermost_hooks()
    if rr.output_hooks is not None:
        rr.output_context = rr.output_hooks.capture()
    kept = {e.storage for e in rr.saved if not e.packed_by_user_hook}
    for j, t in enumerate(items):
        if t is None:
            rr.output_meta.append(None)
            rr.output_versions.append(0)
            continue
        rr.output_meta.append(tensor_meta(t))
        rr.output_versions.append(t._version)
        if t.numel() == 0:
            rr.persisted[j] = PersistedOutput(t.detach(), None, t._version, 0, True)
            continue
        key = storage_key(t)
        if key in kept:
            # Backward keeps this storage anyway: persisting it costs nothing.
            rr.persisted[j] = PersistedOutput(t.detach(), None, t._version, 0, True)
        else:
            record.note_producer(key, rr, j)


def _persist_consumed(record: CheckpointRecord, tree: Any) -> None:
    """Persist every save-region output among the tensors in ``tree``."""
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            _persist_if_produced(record, t)


def _persist_if_produced(record: CheckpointRecord, t: torch.Tensor) -> None:
    """Keep ``t`` for replay if a save region produced its storage (once)."""
    if t.numel() == 0:
        return
    hit = record.producer_of(storage_key(t))
    if hit is None:
        return
    rr, j = hit
    if j in rr.persisted:
        return
    out = rr.outputs[j]
    if out._version != rr.output_versions[j]:
        raise RematError(
            f"remat_dist: output {j} of save region {rr.name!r} was modified in place "
            "after the region returned, and replay needs it. Replay would see other "
            "values than the forward did. Fix: clone it before modifying "
            "(y = out.clone(); y.add_(...)) or modify it inside the region."
        )
    # the hooks (and context) where the region returned, not those active here:
    # the output belongs to its producer's hooks even after their block exited
    user = rr.output_hooks
    nbytes = storage_nbytes(out)
    if user is None:
        rr.persisted[j] = PersistedOutput(out.detach(), None, out._version, nbytes, False)
    else:
        info = SavedTensorInfo(
            SavedTensorKind.SAVE_OUTPUT,
            rr.output_context,
            checkpoint=record.name,
            region=rr.name,
        )
        packed = user.pack_with(for_user_hook(out), info)
        rr.persisted[j] = PersistedOutput(
            packed, user.unpack_with, out._version, nbytes, False
        )


BELOW_METADATA_KEY = "remat_dist.below"
"""``grad_fn.metadata`` key of a checkpoint output's node: its :class:`_Below`."""

_will_run = _autograd.will_execute_node
_sequence = _autograd.node_sequence


class _Below:
    """The nodes right below one output node of a checkpoint, kept in that node's
    metadata: owned by the output node, so they live as long as it does and form
    no cycle (the graph only points downwards); the record refers to it weakly."""

    __slots__ = ("nodes", "__weakref__")

    def __init__(self, nodes: list[Any]) -> None:
        self.nodes = nodes


class ForwardGraph:
    """What a checkpoint's forward left for :func:`replay_frees_graph`: the sequence
    numbers ``[first, end)`` of the nodes it made, weak references to the
    :class:`_Below` of its output nodes, and how many of torch's holders come first
    and belong to no node a backward runs (the replay anchor under user hooks)."""

    __slots__ = ("span", "below", "skip")

    def __init__(
        self, span: tuple[int, int], below: tuple[Any, ...], skip: int
    ) -> None:
        self.span = span
        self.below = below
        self.skip = skip


def note_forward(record: CheckpointRecord, out: Any, first: int, anchored: bool) -> None:
    """At a checkpoint's forward end (its nodes made from sequence number ``first``
    on): if it persisted a save-region output, note its nodes for the replays."""
    if not any(r.persisted for r in record.regions):
        return
    end = _autograd.sequence_counter()
    below = []
    seen: set[int] = set()
    for t in (out,) if isinstance(out, torch.Tensor) else tree_leaves(out):
        node = t.grad_fn if isinstance(t, torch.Tensor) else None
        if node is None or id(node) in seen or not first <= _sequence(node) < end:
            continue  # (an input returned as it is: another node's metadata)
        seen.add(id(node))
        cell = _Below([c for c, _ in node.next_functions if c is not None])
        node.metadata[BELOW_METADATA_KEY] = cell
        below.append(weakref.ref(cell))
    skip = 1 if anchored else 0
    record.forward_graph = ForwardGraph((first, end), tuple(below), skip)


def replay_frees_graph(record: CheckpointRecord) -> bool:
    """At a replay's start: whether the backward running it keeps no graph and will
    run every node still holding one of the checkpoint's holders, so that no later
    backward can replay it (see the module's docstring). False outside backward,
    where nothing says which nodes a backward will run, or without the note."""
    graph = record.forward_graph
    if graph is None or _autograd.graph_task_keeps_graph():
        return False
    running = _autograd.current_node()
    hooks = _autograd.top_saved_tensors_hooks(False)
    target = None if hooks is None else replay_target(hooks[0])
    if running is None or target is None:
        return False
    holders = live_holders(target[0], graph.skip)  # kept alive: ids stay unique
    live = {id(h) for h in holders}
    first, end = graph.span
    stack = [running]
    for ref in graph.below:
        cell = ref()
        if cell is None:
            return False  # an output's node is gone, and what it reached unknown
        stack.extend(cell.nodes)
    visited: list[Any] = []  # kept alive while the walk runs: ids stay unique
    seen: set[int] = set()
    push, pop = stack.append, stack.pop
    while stack:
        node = pop()
        key = id(node)
        if key in seen:
            continue
        seen.add(key)
        visited.append(node)
        if not first <= _sequence(node) < end:
            continue  # not made by this checkpoint's forward
        held = 0
        names = _saved_names.get(type(node))
        if names is None:
            names = _saved_names[type(node)] = _autograd.raw_saved_names(type(node))
        for name in names:
            try:
                value = getattr(node, name)
            except RuntimeError:  # freed by a backward that ran the node
                continue
            for saved in value if isinstance(value, (tuple, list)) else (value,):
                try:
                    key = id(saved.data)  # what the pack hook returned, not unpacked
                except (RuntimeError, AttributeError):
                    continue
                if key in live:
                    live.discard(key)
                    held += 1
        below = node.next_functions
        if held and node is not running and not _runs(node, below):
            return False
        if not live:
            return True
        for child, _ in below:
            if child is not None:
                push(child)
    return not live


def _runs(node: Any, below: tuple[tuple[Any, int], ...]) -> bool:
    """Whether the running graph task will run ``node`` (and so free what it saved:
    the task keeps no graph). torch's answer for the node, checked on its children
    (``below``): a node the task needs has a child it runs or captures."""
    try:
        if not _will_run(node):
            return False
    except RuntimeError:
        return False
    for child, _ in below:
        if child is None:
            continue
        try:
            if _will_run(child):
                return True
        except RuntimeError:  # a leaf whose gradient this autograd.grad captures
            return True
    return False


class _SavedNames(dict[type, tuple[str, ...]]):
    """Per node class, the attributes giving its saved tensors (a cache)."""

    def reset(self) -> None:
        self.clear()


_saved_names = register_state("core.saved_names", _SavedNames())
