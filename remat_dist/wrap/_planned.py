"""The seam between ``apply_remat`` and a policy decided at run time.

A ``MemoryBudget`` cannot say what each block keeps before it has measured them.
``apply_remat`` hands such a policy a :class:`~remat_dist.wrap._install.BlockInstaller`
for the selected blocks (each checkpointed with full recompute first) and keeps
the :class:`Planner` it returns on the model; ``remove_remat`` detaches it. The
wrapping layer knows nothing else of planners: ``remat_dist.budget`` plugs in here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from torch import nn

from remat_dist.wrap._install import BlockInstaller

__all__ = ["PLANNER_ATTR", "PlannedPolicy", "Planner", "planner_of"]

PLANNER_ATTR = "_remat_dist_planner"
"""Instance attribute of a model under a planned policy: its :class:`Planner`."""


@runtime_checkable
class Planner(Protocol):
    """What a planned policy attached to one model."""

    def detach(self) -> None:
        """Stop planning (``remove_remat``); the checkpoints are removed apart."""
        ...


@runtime_checkable
class PlannedPolicy(Protocol):
    """A ``policy=`` that decides per block at run time."""

    regions: Sequence[str] | None
    """Save-region candidates (paths relative to each block); None: its default."""

    def with_regions(self, regions: Sequence[str]) -> PlannedPolicy:
        """The same policy with ``regions`` as candidates (a model adapter's)."""
        ...

    def planner(self, model: nn.Module, installer: BlockInstaller) -> Any:
        """Check the policy against the blocks (raising before anything changes)
        and return the call that attaches a :class:`Planner`, run once every block
        has its full-recompute checkpoint."""
        ...


def planner_of(model: nn.Module) -> Planner | None:
    """The planner attached to ``model`` (None: a fixed policy)."""
    return model.__dict__.get(PLANNER_ATTR)
