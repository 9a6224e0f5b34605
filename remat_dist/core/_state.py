"""Context-local runtime state (a leaf module: imports nothing from remat_dist).

Everything that says "where are we" lives here, in ``contextvars``, so that two
threads (or two asyncio tasks) training independently never see each other's
checkpoints, regions or scopes.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from torch.compiler import is_compiling as _is_compiling

if TYPE_CHECKING:
    from remat_dist.core._record import CheckpointRecord

__all__ = ["current_frame", "is_recomputing", "frame_var", "hooks_var", "name_prefix_var"]

frame_var: ContextVar[CheckpointRecord | None] = ContextVar(
    "remat_dist_frame", default=None
)
"""The checkpoint whose forward or replay is running in this context, if any."""

name_prefix_var: ContextVar[str] = ContextVar("remat_dist_name_prefix", default="")
"""The ``name_scope`` prefix (``a/b/``) applied to region names."""

hooks_var: ContextVar[tuple[Any, ...]] = ContextVar("remat_dist_hooks", default=())
"""The stack of ``remat_dist.saved_tensors_hooks`` active in this context."""

fallback_replay_var: ContextVar[bool] = ContextVar("remat_dist_fallback_replay", default=False)
"""True while torch's checkpoint replays the body of a compiled checkpoint that
Dynamo ran eagerly after a graph break (``core._compile``)."""


def current_frame() -> CheckpointRecord | None:
    """The checkpoint frame running in this context, or None (always None while
    ``torch.compile`` traces: compiled checkpoints have no frame)."""
    if _is_compiling():
        return None
    return frame_var.get()


def is_recomputing() -> bool:
    """Whether a checkpoint is being replayed now (in this context).

    Use it to keep forward-only side effects, such as logging, metrics or a cache
    update, out of the replay.

    Returns:
        ``True`` only during a replay.

    Example::

        >>> if not remat_dist.is_recomputing():
        ...     record_metric(value)
    """
    if _is_compiling():
        # Dynamo traces the forward; the compiled backward recomputes graph ops,
        # never Python (docs/compile.md)
        return False
    frame = frame_var.get()
    if frame is None:
        return fallback_replay_var.get()
    return frame.replaying
