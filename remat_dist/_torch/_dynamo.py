"""Dynamo's private pieces: its process-wide reset, constant folding at trace time,
its recompile limit, its backends by name, and functorch's config (the
benchmarks, the compiled memory budget)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = [
    "assume_constant_result",
    "cache_size_limit",
    "cache_size_limit_at_least",
    "functorch_config_patch",
    "lookup_backend",
    "reset",
    "set_cache_size_limit",
]

F = TypeVar("F", bound=Callable[..., Any])


def reset() -> None:
    """Drop every compiled graph of the process (the next call recompiles)."""
    torch._dynamo.reset()


def assume_constant_result(fn: F) -> F:
    """Decorator: Dynamo calls ``fn`` at trace time and folds its result into the
    graph as a constant (no guard)."""
    return torch._dynamo.assume_constant_result(fn)


def cache_size_limit() -> int:
    """How many graphs Dynamo keeps per code object before it stops recompiling."""
    return torch._dynamo.config.cache_size_limit


def set_cache_size_limit(limit: int) -> None:
    torch._dynamo.config.cache_size_limit = limit


def cache_size_limit_at_least(limit: int) -> Any:
    """A context manager under which Dynamo keeps at least ``limit`` graphs per
    code object (the budget's compiled side passes: one per candidate)."""
    limit = max(limit, torch._dynamo.config.cache_size_limit)
    return torch._dynamo.config.patch(cache_size_limit=limit)


def lookup_backend(name: str) -> Callable[..., Any]:
    """The compiler function ``torch.compile(backend=name)`` uses."""
    return torch._dynamo.lookup_backend(name)


def functorch_config_patch(**changes: Any) -> Any:
    """A context manager that sets functorch config values (e.g.
    ``activation_memory_budget``) for its block."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(**changes)
