"""The exceptions remat_dist raises.

All share one base, :class:`RematError`, so a training loop can catch them together.
Every message names the checkpoint region (and the region inside it), the rank where
one exists, and the fix.
"""

from __future__ import annotations

from torch.utils.checkpoint import CheckpointError

__all__ = [
    "RematError",
    "RematUsageError",
    "PlaceholderAccessError",
    "CollectiveReplayError",
    "PlanMismatchError",
    "AgreementSetupError",
    "ReplayMismatchError",
    "ReplayValueMismatchError",
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


class AgreementSetupError(RematError):
    """The ranks of a replay group could not set up the gloo group their agreement runs on:
    every rank came, but some could not connect to others.

    The message names the ranks, where each one's gloo listens (the interface or
    the address its host name resolves to) and gloo's own error; the fix is the
    network's (``GLOO_SOCKET_IFNAME``, the host name's address, a firewall), not
    the plan's.
    """


class ReplayMismatchError(RematError, CheckpointError):
    """A checkpoint's replay did not reproduce its forward: a tensor saved for
    backward has another shape, dtype or device on replay, or fewer were saved.

    The message names the checkpoint, the region, the tensor (its position, the op
    that made it on replay and the line of model code that saved it), the forward's
    and the replay's metadata, and the likely causes with their fixes (a cache appended to
    on every call, a counter or flag: ``use_cache=False``, ``recompute_state_hooks``,
    ``remat_dist.is_recomputing()``). Also a ``torch.utils.checkpoint``
    ``CheckpointError``, which torch raises for the same case after the replay,
    so code written to catch that keeps catching it.
    """


class ReplayValueMismatchError(CollectiveReplayError, ReplayMismatchError):
    """A replay computed other values than its forward, with the same shapes and
    dtypes (``determinism_check="values"`` or ``REMAT_DIST_DETERMINISM_CHECK=values``):
    the input of a replayed collective, or a tensor the replay saved for backward
    in place of the forward's, has another fingerprint.

    Raised at the end of backward, before the optimizer step: with a process group,
    on every rank of the replay group (through the end-of-backward report), the
    message naming the checkpoint, the collective or saved tensor (and the op that
    made it), the ranks where it differed and the fixes. The gradients of that step
    are wrong. A ``CollectiveReplayError`` and a ``ReplayMismatchError``, so code
    that catches either keeps catching it.
    """


# Users import and catch these from ``remat_dist``; tracebacks and pickles say so.
for _cls in (
    RematError,
    RematUsageError,
    PlaceholderAccessError,
    CollectiveReplayError,
    PlanMismatchError,
    AgreementSetupError,
    ReplayMismatchError,
    ReplayValueMismatchError,
):
    _cls.__module__ = "remat_dist"
del _cls
