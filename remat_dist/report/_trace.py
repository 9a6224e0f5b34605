"""``collect_trace`` and ``trace_scope``: the region hierarchy a forward ran.

::

    with remat_dist.collect_trace() as trace:
        loss = model(inputs).sum()
    print(trace.format())

    remat_dist trace
    scope [test_flag]
      layers.0: checkpoint
        attention: save
        mlp: recompute

Levels are ``trace_scope`` calls, checkpoints (``name: checkpoint``) and the
regions inside them (``name: save|recompute``), nested as they ran. Only forward is
recorded: a replay during backward, even inside the ``with`` block, adds nothing.
Regions outside any checkpoint are plain calls; they appear with the decision they
would have inside one.

``trace.roots`` holds the levels as :class:`TraceNode` s, checkpoints included.
``trace.entries`` is torch_remat's shape of the same trace: :class:`OpTrace` per
region and :class:`ScopeTrace` per ``trace_scope``, with no checkpoint level
(torch_remat records none), so code that walks a torch_remat trace runs unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

from remat_dist.core import (
    CheckpointRecord,
    RegionRecord,
    is_recomputing,
    register_observer,
)

__all__ = ["OpTrace", "ScopeTrace", "Trace", "TraceNode", "collect_trace", "trace_scope"]

F = TypeVar("F", bound=Callable[..., Any])

HEADER = "remat_dist trace"


@dataclass
class TraceNode:
    """One level of the trace.

    ``kind`` is ``"scope"``, ``"checkpoint"``, ``"save"`` or ``"recompute"``.
    """

    kind: str
    name: str
    metadata: Any = None
    children: list[TraceNode] = field(default_factory=list)
    key: Any = field(default=None, repr=False, compare=False)

    def label(self) -> str:
        if self.kind == "scope":
            return self.name + _format_metadata(self.metadata)
        return f"{self.name}: {self.kind}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "name": self.name}
        if self.metadata is not None:
            out["metadata"] = self.metadata
        out["children"] = [c.to_dict() for c in self.children]
        return out


@dataclass
class OpTrace:
    """A region in :attr:`Trace.entries` (torch_remat's field): its name (with
    ``name_scope`` prefixes) and whether it recomputes."""

    name: str
    recompute: bool


@dataclass
class ScopeTrace:
    """A ``trace_scope`` level in :attr:`Trace.entries`, with what ran inside it."""

    name: str
    metadata: Any = None
    entries: list[OpTrace | ScopeTrace] = field(default_factory=list)


def _entries_of(nodes: list[TraceNode]) -> list[OpTrace | ScopeTrace]:
    """torch_remat's entries for ``nodes``: checkpoint levels give way to their
    children."""
    out: list[OpTrace | ScopeTrace] = []
    for node in nodes:
        if node.kind == "checkpoint":
            out.extend(_entries_of(node.children))
        elif node.kind == "scope":
            out.append(ScopeTrace(node.name, node.metadata, _entries_of(node.children)))
        else:
            out.append(OpTrace(node.name, node.kind == "recompute"))
    return out


def _format_metadata(metadata: Any) -> str:
    if metadata is None:
        return ""
    if isinstance(metadata, Mapping):
        inner = ", ".join(f"{k}={v}" for k, v in metadata.items())
    elif isinstance(metadata, (list, tuple, set, frozenset)):
        inner = ", ".join(str(v) for v in metadata)
    else:
        inner = str(metadata)
    return f" [{inner}]"


class Trace:
    """A recorded region hierarchy, what :func:`~remat_dist.collect_trace` gives.

    ``format()`` renders it as text (each checkpoint and region, kept or
    recomputed); ``roots`` holds the tree; ``entries`` gives it as torch_remat does.

    Example::

        >>> with remat_dist.collect_trace() as trace:
        ...     model(x)
        >>> print(trace.format())
    """

    def __init__(self) -> None:
        self.roots: list[TraceNode] = []
        self._stack: list[TraceNode] = []

    # -- recording -------------------------------------------------------------
    def _push(self, node: TraceNode) -> None:
        (self._stack[-1].children if self._stack else self.roots).append(node)
        self._stack.append(node)

    def _pop(self, key: Any) -> None:
        # Pop up to and including the level opened for ``key``; levels left open
        # by an exception inside them are closed with it.
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i].key is key:
                for node in self._stack[i:]:
                    node.key = None  # never keep a record alive from a trace
                del self._stack[i:]
                return

    # -- observer seam -----------------------------------------------------------
    def on_checkpoint_start(self, record: CheckpointRecord, replay: bool) -> None:
        if not replay and self._mine():
            self._push(TraceNode("checkpoint", record.name, key=record))

    def on_checkpoint_end(
        self, record: CheckpointRecord, replay: bool, error: BaseException | None
    ) -> None:
        if not replay and self._mine():
            self._pop(record)

    def on_region_start(
        self, record: CheckpointRecord, region: RegionRecord, replay: bool
    ) -> None:
        if not replay and self._mine():
            kind = "save" if not region.recompute else "recompute"
            self._push(TraceNode(kind, region.local_name, key=region))

    def on_region_end(
        self, record: CheckpointRecord, region: RegionRecord, replay: bool
    ) -> None:
        if not replay and self._mine():
            self._pop(region)

    def _mine(self) -> bool:
        return self in _active.get()

    # -- reading -------------------------------------------------------------------
    def format(self) -> str:
        """Header line, then one line per level, indented two spaces per depth."""
        lines = [HEADER]

        def emit(node: TraceNode, depth: int) -> None:
            lines.append("  " * depth + node.label())
            for child in node.children:
                emit(child, depth + 1)

        for root in self.roots:
            emit(root, 0)
        return "\n".join(lines)

    @property
    def entries(self) -> list[OpTrace | ScopeTrace]:
        """torch_remat's view of the trace: :class:`OpTrace` per region,
        :class:`ScopeTrace` per scope, nested as they ran, without checkpoint
        levels (their regions take their place). Built afresh on each read."""
        return _entries_of(self.roots)

    def decisions(self) -> list[tuple[str, str]]:
        """``(path, kind)`` for every level in order; paths join names with ``/``."""
        out: list[tuple[str, str]] = []

        def walk(node: TraceNode, prefix: str) -> None:
            path = prefix + node.name
            out.append((path, node.kind))
            for child in node.children:
                walk(child, path + "/")

        for root in self.roots:
            walk(root, "")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"roots": [r.to_dict() for r in self.roots]}

    def __str__(self) -> str:
        return self.format()


_active: ContextVar[tuple[Trace, ...]] = ContextVar("remat_dist_traces", default=())


@contextmanager
def collect_trace() -> Iterator[Trace]:
    """Record the region hierarchy that the forward inside the block runs.

    Traces are per context (thread or asyncio task): another thread's checkpoints do
    not show up. Nested ``collect_trace`` blocks each record what runs inside them.

    Returns:
        A context manager whose value is a :class:`~remat_dist.report.Trace`,
        filled when the block exits.

    Example::

        >>> with remat_dist.collect_trace() as trace:
        ...     loss = model(x).sum()
        >>> print(trace.format())  # each checkpoint and region, kept or recomputed
    """
    trace = Trace()
    token = _active.set(_active.get() + (trace,))
    handle = register_observer(trace)
    try:
        yield trace
    finally:
        handle.remove()
        _active.reset(token)
        for node in trace._stack:
            node.key = None
        trace._stack.clear()


def trace_scope(function: F, name: str, *, metadata: Any = None) -> F:
    """Wrap ``function`` so that its calls add a level ``name`` to active traces.

    Without an active trace, or during a replay, the wrapper is a plain call.

    Args:
        function: the callable to wrap.
        name: the level's name in the trace.
        metadata: shown after the name (``scope [test_flag]``).

    Returns:
        A callable with ``function``'s signature.

    Example::

        >>> with remat_dist.collect_trace() as trace:
        ...     remat_dist.trace_scope(block, "scope", metadata=["test_flag"])(x)
    """
    if not callable(function):
        raise TypeError(f"trace_scope(function, {name!r}): function must be callable")
    if not isinstance(name, str) or not name:
        raise TypeError(f"trace_scope: name must be a non-empty string, got {name!r}")

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        traces = _active.get()
        if not traces or is_recomputing():
            return function(*args, **kwargs)
        key = object()
        for trace in traces:
            trace._push(TraceNode("scope", name, metadata, key=key))
        try:
            return function(*args, **kwargs)
        finally:
            for trace in traces:
                trace._pop(key)

    return wrapper  # type: ignore[return-value]
