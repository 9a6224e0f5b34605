"""Calling a checkpoint's :class:`RecomputeStateHook` s, with errors that say where.

Both the checkpoint's phases (entry, replay start and end) and save regions (the
state after each one, restored when replay skips it) snapshot and restore the same
hooks; the calls live here so that neither module imports the other for them.
"""

from __future__ import annotations

from typing import Any

from remat_dist._errors import RematError
from remat_dist.core._record import CheckpointRecord


def _snapshot(record: CheckpointRecord, where: str) -> tuple[Any, ...]:
    """Every state hook's current state, in hook order (``where`` names the point
    in errors)."""
    states = []
    for h in record.state_hooks:
        try:
            states.append(h.snapshot())
        except Exception as e:
            raise RematError(
                f"remat_dist: state hook {type(h).__name__}.snapshot() raised {e!r} in "
                f"checkpoint {record.name!r} ({where}). Fix the hook, or leave it out "
                "of recompute_state_hooks."
            ) from e
    return tuple(states)


def _restore(record: CheckpointRecord, states: tuple[Any, ...], where: str) -> None:
    """Put back what :func:`_snapshot` took (``where`` names the point in errors)."""
    for h, s in zip(record.state_hooks, states):
        try:
            h.restore(s)
        except Exception as e:
            raise RematError(
                f"remat_dist: state hook {type(h).__name__}.restore() raised {e!r} in "
                f"checkpoint {record.name!r} ({where}). Fix the hook, or leave it out "
                "of recompute_state_hooks."
            ) from e

