"""The exceptions remat_dist raises.

All share one base, :class:`RematError`, so a training loop can catch them together.
Every message names the checkpoint region (and the region inside it), the rank where
one exists, and the fix.
"""

from __future__ import annotations

__all__ = [
    "RematError",
    "RematUsageError",
    "PlaceholderAccessError",
    "CollectiveReplayError",
    "PlanMismatchError",
]


class RematError(RuntimeError):
    """Base of every error remat_dist raises on purpose."""


class RematUsageError(RematError, TypeError):
    """Misuse found at the call: wrong argument types, nesting, duplicate names.

    Also a ``TypeError`` so that code written against ``torch.utils.checkpoint``'s
    argument errors keeps catching it.
    """


class PlaceholderAccessError(RematError):
    """A skipped save region's output was read during replay.

    The message names the producing region and the two fixes: persist the output with
    ``recompute_needs_tensor`` or consume it inside a ``region``.
    """


class CollectiveReplayError(RematError):
    """A replay tried to issue a collective the forward did not (or in another order,
    group, shape or dtype), or a peer rank diverged."""


class PlanMismatchError(RematError):
    """Ranks disagree on the sequence of checkpoints/regions or their decisions."""
