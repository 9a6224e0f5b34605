"""``@distributed``: a pytest test whose body runs on every rank."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, overload

from remat_dist.testing._run import current_test_name, fn_reference, run_task

__all__ = ["distributed"]

F = TypeVar("F", bound=Callable[..., Any])


@overload
def distributed(world_size: F) -> F: ...


@overload
def distributed(
    world_size: int = 2,
    *,
    timeout: float = 60.0,
    mesh_shape: tuple[int, ...] | None = None,
    mesh_dim_names: tuple[str, ...] | None = None,
) -> Callable[[F], F]: ...


def distributed(
    world_size: Any = 2,
    *,
    timeout: float = 60.0,
    mesh_shape: tuple[int, ...] | None = None,
    mesh_dim_names: tuple[str, ...] | None = None,
) -> Any:
    """Make a pytest test run its body on ``world_size`` ranks of a gloo group.

    ::

        from remat_dist.testing import distributed

        @distributed(world_size=2)
        def test_all_reduce(ctx):
            t = torch.tensor([ctx.rank + 1.0])
            dist.all_reduce(t)
            assert t.item() == 3.0

        @pytest.mark.parametrize("n", [1, 4])
        @distributed(world_size=4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
        def test_mesh(ctx, n):
            assert ctx.mesh["tp"].size() == 2

    The body may take a first parameter named ``ctx`` (a :class:`DistContext`:
    ``rank``, ``world_size``, ``mesh``, ``shared_dir``); its other parameters are
    pytest's (fixtures, ``parametrize`` arguments): their values are computed in the
    pytest process and sent, pickled, to every rank. The test fails when the body
    fails on any rank, with that rank's traceback; it fails after ``timeout``
    seconds when some rank is still inside it, naming those ranks.

    The body runs in long-lived rank processes shared by every test of this world
    size: leave the process group alone (no ``destroy_process_group``), and seed the
    generators you use. Fixtures and ``setup_method`` run in the pytest process
    only. Methods of test classes work: the body gets a fresh instance (made with no
    arguments) on each rank. ``@distributed`` alone means ``@distributed()``.

    Args:
        world_size: number of ranks.
        timeout: seconds the body may take once the ranks are ready.
        mesh_shape / mesh_dim_names: build a ``DeviceMesh`` (once per shape and
            names, then reused), available as ``ctx.mesh``.

    Returns:
        A decorator for a pytest test function.
    """
    if callable(world_size):
        return distributed()(world_size)

    def decorate(body: F) -> F:
        sig = inspect.signature(body)
        params = list(sig.parameters.values())
        is_method = bool(params) and params[0].name == "self"
        rest = params[1:] if is_method else params
        wants_ctx = bool(rest) and rest[0].name == "ctx"
        outer = rest[1:] if wants_ctx else rest
        for p in outer:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(
                    f"@distributed test {body.__qualname__} cannot take *args or "
                    "**kwargs; name each fixture or parameter"
                )
        # Checked now, so a local function fails at collection, not on the ranks.
        ref = fn_reference(body, method=is_method, wants_ctx=wants_ctx)
        pytest_sig = sig.replace(parameters=(params[:1] if is_method else []) + outer)

        @functools.wraps(body)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            bound = pytest_sig.bind(*args, **kwargs)
            values = dict(bound.arguments)
            if is_method:
                values.pop(params[0].name, None)
            run_task(
                ref,
                (),
                values,
                world_size=world_size,
                timeout=timeout,
                mesh_shape=mesh_shape,
                mesh_dim_names=mesh_dim_names,
                test_name=current_test_name(body),
            )

        wrapper.__signature__ = pytest_sig  # type: ignore[attr-defined]
        wrapper._remat_dist_body = body  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate
