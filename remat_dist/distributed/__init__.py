"""Rank-aware pieces of remat_dist, plugged into the core through its seams.

Importing this package (``import remat_dist`` does) attaches, with a process group:

* the collective ledger: every checkpoint records the collectives its forward
  issues; replay checks each one before issuing it (``collectives="replay"``) or
  issues none and serves the kept outputs (``collectives="save"``); divergence
  raises :class:`~remat_dist.errors.CollectiveReplayError` on every rank at stake;
* a plan agreement among the ranks at stake (the groups whose collectives a
  replay can re-issue) before backward's first collective, and a failure report
  among them at backward's end, on a gloo group of those ranks only
  (``join_agreements`` makes a rank that checkpoints nothing take part;
  ``check_plan_consistency`` compares the full plan of a group on demand);
* with ``determinism_check="values"``, a value check of every replayed
  collective's input and saved tensor, reported among the ranks at stake
  (``_values``);
* the default state hooks: ``checkpoint`` keeps this rank's RNG aligned on replay
  without user code (``default_state_hooks``);
* collectives issued under ``remat_dist.saved_tensors_hooks`` outside a
  checkpoint go out without those hooks in the backend's work (no Python object
  for its thread to free at interpreter exit);
* at interpreter exit, reference cycles are collected while the interpreter is
  whole, so a process group held by one (a model built inside ``main()``) is not
  destroyed during finalization, where gloo aborts the process (``_exit``).

Without an initialised process group none of it costs anything. The user API
(``set_replay_timeout``, ``join_agreements``, ``step_stats``, the RNG hooks, ...)
is published here (see docs/api.md); ``__all__`` here lists what the layers and
side packages above use.
"""

import functools

from remat_dist._state import register_state
from remat_dist._torch import _fsdp
from remat_dist.core import set_saved_hooks_extent
from remat_dist.distributed import (
    _exit,  # noqa: F401  (closes links and collects cycles at interpreter exit)
    _options,  # noqa: F401  (declares collectives=)
    _values,  # noqa: F401  (the value check's observer)
)
from remat_dist.distributed._check import (
    check_plan_consistency as check_plan_consistency,  # published here
)
from remat_dist.distributed._intercept import ObserverExtent
from remat_dist.distributed._objects import all_gather_objects
from remat_dist.distributed._rank_device import rank_device
from remat_dist.distributed._ready import dist_ready
from remat_dist.distributed._replay import ledger_of
from remat_dist.distributed._rng import CPURNGStateHook as CPURNGStateHook
from remat_dist.distributed._rng import DeviceRNGStateHook as DeviceRNGStateHook
from remat_dist.distributed._rng import DTensorRNGStateHook as DTensorRNGStateHook
from remat_dist.distributed._rng import GeneratorStateHook as GeneratorStateHook
from remat_dist.distributed._rng_default import (
    default_state_hooks as default_state_hooks,  # published here
)
from remat_dist.distributed._rng_default import install_default_provider
from remat_dist.distributed._step import (
    StepStats as StepStats,  # published here
)
from remat_dist.distributed._step import (
    join_agreements as join_agreements,  # published here
)
from remat_dist.distributed._step import reset_step_state
from remat_dist.distributed._step import (
    set_replay_timeout as set_replay_timeout,  # published here
)
from remat_dist.distributed._step import (
    step_stats as step_stats,  # published here
)

install_default_provider()
# collectives issued while remat_dist.saved_tensors_hooks are torch's hooks go
# out without them (see _intercept._issue_bare)
set_saved_hooks_extent(functools.partial(ObserverExtent, None))


register_state("distributed.fsdp_tracking", _fsdp.STATE)

__all__ = [
    "all_gather_objects",
    "dist_ready",
    "install_default_provider",
    "ledger_of",
    "rank_device",
    "reset_step_state",
]


# -- for the layers above: their own collectives and hook extents (append only)
from remat_dist.distributed._intercept import _bypass as _own_collectives  # noqa: E402


def own_collectives():  # type: ignore[no-untyped-def]
    """A context in which this thread's collectives are the caller's own (a
    planner's exchange of its measurements), not the model's: no ledger, no
    agreement, no observer sees them.

    Example::

        with own_collectives():
            tables = all_gather_objects(mine, group=group)
    """
    return _own_collectives()


def bare_hooks_extent() -> ObserverExtent:
    """Start an extent in which collectives this thread issues under Python
    saved-tensor hooks go out without them (as outside any checkpoint); end it
    with ``.pop()``. Nothing without a process group.

    Returns:
        the extent (its ``pop()`` is idempotent).
    """
    return ObserverExtent(None)


__all__ += ["bare_hooks_extent", "own_collectives"]


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    if name == "mark_step":  # its name until 0.1.0 (torch_xla's word for another thing)
        import warnings

        warnings.warn(
            "remat_dist.distributed.mark_step is deprecated and goes in remat_dist "
            "0.2.0: use remat_dist.distributed.join_agreements (the same function: "
            "this rank takes part in the forward's agreements)",
            DeprecationWarning,
            stacklevel=2,
        )
        return join_agreements
    raise AttributeError(f"module 'remat_dist.distributed' has no attribute {name!r}")
