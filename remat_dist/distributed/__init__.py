"""Rank-aware pieces of remat_dist, plugged into the core through its seams.

Importing this package (``import remat_dist`` does) attaches, with a process group:

* the collective ledger: every checkpoint records the collectives its forward
  issues; replay checks each one before issuing it (``collectives="replay"``) or
  issues none and serves the kept outputs (``collectives="save"``); divergence
  raises :class:`~remat_dist.errors.CollectiveReplayError` on every rank;
* a plan agreement among the ranks at stake (the groups whose collectives a
  replay can re-issue) before backward's first collective, and a failure report
  among them at backward's end, on a side channel between those ranks
  (:func:`mark_step` makes a rank that checkpoints nothing take part;
  :func:`check_plan_consistency` compares the full plan of a group on demand);
* the default state hooks: ``checkpoint`` keeps this rank's RNG aligned on replay
  without user code (see :func:`default_state_hooks`).

Without an initialised process group none of it costs anything.
"""

from remat_dist.distributed import _options  # noqa: F401  (declares collectives=)
from remat_dist.distributed._objects import all_gather_objects
from remat_dist.distributed._rank_device import rank_device
from remat_dist.distributed._ready import dist_ready
from remat_dist.distributed._replay import ledger_of
from remat_dist.distributed._rng_default import (
    default_state_hooks,
    install_default_provider,
)
from remat_dist.distributed._step import (
    check_plan_consistency,
    mark_step,
    reset_step_state,
    set_replay_timeout,
    step_stats,
)
from remat_dist.distributed.rng import (
    CPURNGStateHook,
    DeviceRNGStateHook,
    DTensorRNGStateHook,
    GeneratorStateHook,
)
from remat_dist.errors import CollectiveReplayError, PlanMismatchError

install_default_provider()

__all__ = [
    "all_gather_objects",
    "dist_ready",
    "CollectiveReplayError",
    "PlanMismatchError",
    "check_plan_consistency",
    "ledger_of",
    "mark_step",
    "reset_step_state",
    "set_replay_timeout",
    "step_stats",
    "CPURNGStateHook",
    "DTensorRNGStateHook",
    "DeviceRNGStateHook",
    "GeneratorStateHook",
    "default_state_hooks",
    "install_default_provider",
    "rank_device",
]
