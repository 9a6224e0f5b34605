"""What a compiled checkpoint runs when torch's checkpoint executes it for real (a
graph break in its body, ``backend="eager"``): the state hooks' snapshots and the
selective-checkpoint contexts around them (see ``_compile._sac_contexts``)."""

from __future__ import annotations

from typing import Any

import torch

from remat_dist.core._state import fallback_replay_var

__all__ = ["RuntimeContext", "RuntimeStates", "mutated_at_runtime"]


class RuntimeStates:
    """The state hooks of one checkpoint run for real, and their forward states."""

    def __init__(self, hooks: tuple[Any, ...]) -> None:
        self.hooks = hooks
        self.entry: list[Any] = []

    def snapshot(self) -> list[Any]:
        return [h.snapshot() for h in self.hooks]

    def restore(self, states: list[Any]) -> None:
        for h, state in zip(self.hooks, states):
            h.restore(state)


class RuntimeContext:
    """torch's selective-checkpoint context at run time, plus the state hooks and,
    on the recompute, ``fallback_replay_var`` (see :func:`_sac_contexts`)."""

    def __init__(self, inner: Any, states: RuntimeStates, replay: bool) -> None:
        self.inner = inner
        self.states = states
        self.replay = replay
        self._outside: list[tuple[list[Any], Any]] = []

    def __enter__(self) -> Any:
        if not self.replay:
            self.states.entry = self.states.snapshot()
            return self.inner.__enter__()
        outside = self.states.snapshot()
        self.states.restore(self.states.entry)
        self._outside.append((outside, fallback_replay_var.set(True)))
        try:
            return self.inner.__enter__()
        except BaseException:
            self._leave()
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            if self.replay:
                self._leave()

    def _leave(self) -> None:
        outside, token = self._outside.pop()
        fallback_replay_var.reset(token)
        self.states.restore(outside)


def mutated_at_runtime(op: Any) -> bool:
    """Whether a save-region op, run eagerly under torch's selective checkpoint,
    must be recomputed rather than kept: an in-place op, or a fresh buffer that an
    in-place op fills next (dropout's ``empty_like(x).bernoulli_(p)``).

    Eager selective checkpoint refuses a kept tensor mutated after it was kept
    (``Tensor cached during selective activation checkpoint has been mutated``).
    Recomputing these is cheap, and exact: the ops after them in the region are
    kept, and torch's checkpoint restores the RNG before its replay. (Traced, the
    graph is functional and every op is kept.)
    """
    schema = getattr(op, "_schema", None)
    return op in _FRESH_BUFFERS or (schema is not None and schema.is_mutable)


_FRESH_BUFFERS = frozenset(
    (
        torch.ops.aten.empty_like.default,
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
    )
)
