"""The CPU generator hook the fsdp tests pass as ``recompute_state_hooks`` (dropout on CPU)."""

from __future__ import annotations

from remat_dist.distributed._rng import CPURNGStateHook


def cpu_hooks() -> tuple:
    return (CPURNGStateHook(),)
