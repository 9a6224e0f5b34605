"""Multi-process test harness: run a function or a pytest test on N real ranks.

The ranks are long-lived CPU processes in a real gloo process group, started once
per world size (per pytest-xdist worker) and reused by every later call, so a warm
2-rank call costs milliseconds rather than the seconds a process spawn costs::

    import torch
    import torch.distributed as dist
    from remat_dist.testing import distributed, run_distributed

    @distributed(world_size=2)
    def test_sum(ctx):                 # the body runs on every rank
        t = torch.tensor([float(ctx.rank)])
        dist.all_reduce(t)
        assert t.item() == 1.0

    def rank_and_size():               # module level: the ranks import it by name
        return dist.get_rank(), dist.get_world_size()

    assert run_distributed(rank_and_size, world_size=4) == [(r, 4) for r in range(4)]

A failure on any rank raises :class:`DistributedTestError` in the caller, naming the
rank(s) and carrying their remote tracebacks; a hang raises
:class:`DistributedTimeoutError` at the timeout, naming the ranks still inside the
call and where they were stuck. Either way the pool is killed and replaced, so
later calls start clean. No fixed ports: the group rendezvous through a FileStore
in a private temporary directory.
"""

from remat_dist._state import reset_process_state
from remat_dist.testing._context import DistContext, dist_context
from remat_dist.testing._decorator import distributed
from remat_dist.testing._errors import (
    DistributedTestError,
    DistributedTimeoutError,
    RankFailure,
)
from remat_dist.testing._peak import PeakSavedBytes
from remat_dist.testing._pool import (
    START_METHOD_ENV,
    PoolStats,
    pool_stats,
    shutdown_pools,
)
from remat_dist.testing._run import run_distributed
from remat_dist.testing._saved import SavedBytesCounter

__all__ = [
    "DistContext",
    "DistributedTestError",
    "DistributedTimeoutError",
    "PeakSavedBytes",
    "PoolStats",
    "RankFailure",
    "SavedBytesCounter",
    "START_METHOD_ENV",
    "dist_context",
    "distributed",
    "pool_stats",
    "reset_process_state",
    "run_distributed",
    "shutdown_pools",
]
