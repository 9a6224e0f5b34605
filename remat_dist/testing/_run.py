"""The entry points of a call: ``run_distributed`` and what ``@distributed`` shares.

Turns a caller's function and arguments into a :class:`Task` the ranks can run:
checks that the function can reach the other processes (an import reference for a
module-level function, else the pickled callable), validates the world size, the
timeout and the mesh, names the call after the running pytest test, and hands the
task to the pool of that world size.
"""

from __future__ import annotations

import inspect
import math
import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

from remat_dist.testing._pool import run_on_pool
from remat_dist.testing._worker import FnRef, Task

__all__ = ["run_distributed", "run_task", "fn_reference", "current_test_name"]


def _describe(fn: Any) -> str:
    mod = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{mod}.{name}"


def current_test_name(fn: Any) -> str:
    """The running pytest test's id, else ``fn``'s qualified name (for messages)."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    if current:
        return current.rsplit(" (", 1)[0]
    return _describe(fn)


def fn_reference(
    fn: Callable[..., Any], *, method: bool = False, wants_ctx: bool = False
) -> Any:
    """What to send to the ranks for ``fn``: an import reference for a module-level
    function, else ``fn`` itself when it pickles (a ``functools.partial`` of one)."""
    if inspect.isfunction(fn):
        qualname = fn.__qualname__
        if "<locals>" in qualname or "<lambda>" in qualname:
            raise TypeError(
                f"{_describe(fn)} cannot run on other ranks: the rank processes "
                "import the function by name, so define it at module level (not "
                "inside another function, and not as a lambda)"
            )
        name = fn.__module__
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if name == "__main__":
            # ``python -m pkg.mod``: the ranks can import pkg.mod by its real name.
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.name:
                name = spec.name
        return FnRef(name, qualname, file, method, wants_ctx)
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"{fn!r} cannot be sent to the rank processes ({exc}); pass a "
            "module-level function"
        ) from exc
    return fn


def _check_mesh(
    world_size: int,
    mesh_shape: tuple[int, ...] | None,
    mesh_dim_names: tuple[str, ...] | None,
) -> tuple[tuple[int, ...] | None, tuple[str, ...] | None]:
    if mesh_shape is None:
        if mesh_dim_names is not None:
            raise ValueError("mesh_dim_names needs mesh_shape")
        return None, None
    shape = tuple(int(s) for s in mesh_shape)
    if math.prod(shape) != world_size:
        raise ValueError(
            f"mesh_shape {shape} has {math.prod(shape)} ranks, world_size is "
            f"{world_size}"
        )
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    if names is not None and len(names) != len(shape):
        raise ValueError(f"mesh_dim_names {names} does not match mesh_shape {shape}")
    return shape, names


def run_task(
    fn_ref: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    world_size: int,
    timeout: float,
    mesh_shape: tuple[int, ...] | None,
    mesh_dim_names: tuple[str, ...] | None,
    test_name: str,
) -> list[Any]:
    """Run one prepared call on a pool (shared by run_distributed and the
    decorator)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    shape, names = _check_mesh(world_size, mesh_shape, mesh_dim_names)
    task = Task(
        fn=fn_ref,
        args=tuple(args),
        kwargs=dict(kwargs),
        mesh_shape=shape,
        mesh_dim_names=names,
        test_name=test_name,
    )
    return run_on_pool(world_size, task, timeout)


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 60.0,
    mesh_shape: tuple[int, ...] | None = None,
    mesh_dim_names: tuple[str, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result.

    The ranks are real processes in a real gloo process group (CPU), started once
    per world size in this process and reused by later calls. Inside ``fn``,
    ``torch.distributed`` is initialised and :func:`dist_context` gives the rank,
    the world size, the mesh and a shared scratch directory.

    Args:
        fn: a module-level function (the ranks import it by name); ``args``,
            ``kwargs`` and the return value must pickle.
        world_size: number of ranks.
        timeout: seconds the call may take once the pool is ready. When it passes,
            the ranks still inside ``fn`` are named (with their Python stacks),
            the pool is killed and replaced, and ``DistributedTimeoutError`` is
            raised.
        mesh_shape / mesh_dim_names: build (once, then cache) a ``DeviceMesh`` with
            ``init_device_mesh("cpu", mesh_shape, mesh_dim_names=...)``, available
            as ``dist_context().mesh``.
        kwargs: keyword arguments for ``fn``.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        DistributedTestError: ``fn`` raised on some rank (or a rank's process died).
            The message names the failing ranks and carries their remote
            tracebacks. When one rank fails while the others block in a collective,
            the error comes about a second after the failure, not at the timeout.
        DistributedTimeoutError: no rank failed but some did not finish in time.

    Example::

        >>> def world(scale):
        ...     return dist.get_world_size() * scale
        >>> if __name__ == "__main__":
        ...     print(run_distributed(world, 10, world_size=2))   # [20, 20]
    """
    ref = fn_reference(fn)
    return run_task(
        ref,
        args,
        kwargs or {},
        world_size=world_size,
        timeout=timeout,
        mesh_shape=mesh_shape,
        mesh_dim_names=mesh_dim_names,
        test_name=current_test_name(fn),
    )
