"""The per-rank context a distributed test body sees."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DistContext", "dist_context"]


class _Running:
    """The context of the body this process runs now (one at a time per rank)."""

    ctx: DistContext | None = None


_RUNNING = _Running()


@dataclass(frozen=True)
class DistContext:
    """Where a test body runs: one rank of a live gloo process group.

    Attributes:
        rank: this process's global rank.
        world_size: number of ranks.
        mesh: the ``DeviceMesh`` asked for with ``mesh_shape`` (built once per shape
            and names on each rank and reused by later tests), else None.
        shared_dir: a fresh directory for this call, the same path on every rank and
            removed after the call.
        test_name: the pytest node id (or the function's qualified name).
    """

    rank: int
    world_size: int
    mesh: DeviceMesh | None
    shared_dir: str
    test_name: str

    @property
    def device(self) -> torch.device:
        """The device tests run on (CPU: the harness uses gloo)."""
        import torch

        return torch.device("cpu")

    @property
    def group(self) -> Any:
        """The default (world) process group."""
        import torch.distributed as dist

        return dist.group.WORLD

    def barrier(self) -> None:
        """Wait for every rank."""
        import torch.distributed as dist

        dist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, indexed by rank (a collective: call it on all)."""
        from remat_dist.distributed import all_gather_objects

        return all_gather_objects(obj)


def dist_context() -> DistContext:
    """The context of the distributed call running in this process.

    Use it from a function given to :func:`run_distributed`, or from helpers called
    by a ``@distributed`` test body. Raises ``RuntimeError`` outside a harness rank.
    """
    current = _RUNNING.ctx
    if current is None:
        raise RuntimeError(
            "dist_context() is only available inside a function run by "
            "remat_dist.testing.run_distributed or a @distributed test body"
        )
    return current


def _set_current(ctx: DistContext | None) -> None:
    _RUNNING.ctx = ctx
