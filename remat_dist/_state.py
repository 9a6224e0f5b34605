"""Process state, one object per concern, and the one reset of all of them.

A module that keeps state for the whole process (caches, the step's agreement
state, FSDP2's tracking depth) keeps it in one object with a ``reset()`` method and
registers that object here under the name of its concern. :func:`reset_process_state`
(published as ``remat_dist.testing.reset_process_state``; the suite's fixtures call
it between tests) resets every registered object, in registration order.

What is not registered, on purpose: registrations made at import (core's observers
and declared options, the model adapters, the kernels at the interception key),
which a reset would break; weak sets of what is alive (``live_records()``), which
empty themselves; and the harness's rank pools, which outlive tests by design.

A leaf: it imports nothing of remat_dist, and every layer may import it.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

__all__ = ["ProcessState", "register_state", "registered_states", "reset_process_state"]


class ProcessState(Protocol):
    def reset(self) -> None:
        """Put the state back as it was at import."""


S = TypeVar("S", bound=ProcessState)


class _Registry:
    """The registered state objects, by concern."""

    def __init__(self) -> None:
        self.states: dict[str, ProcessState] = {}


_REGISTRY = _Registry()


def register_state(concern: str, state: S) -> S:
    """Register ``state`` (an object with ``reset()``) under ``concern``; returns it.
    Registering a concern again replaces its object (a module reloaded)."""
    _REGISTRY.states[concern] = state
    return state


def registered_states() -> dict[str, ProcessState]:
    """The registered state objects by concern (a copy)."""
    return dict(_REGISTRY.states)


def reset_process_state() -> None:
    """Reset every registered state object of this process."""
    for state in list(_REGISTRY.states.values()):
        state.reset()
