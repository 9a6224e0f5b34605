"""The option the distributed layer adds to ``checkpoint`` and ``region``.

Declared through the core's option seam, so the core carries it without knowing
what it means: ``collectives`` (typed ``CollectiveMode`` in the core's
signatures), how collectives inside a checkpoint (or one region) behave on replay:
``"replay"`` re-issues each one, checked against the forward's ledger before it
is issued; ``"save"`` keeps their outputs on forward and issues none on replay.
"""

from __future__ import annotations

from typing import Any, get_args

from remat_dist._errors import RematUsageError
from remat_dist.core import CollectiveMode, OptionSpec, declare_option

__all__ = ["COLLECTIVE_MODES"]

COLLECTIVE_MODES: tuple[str, ...] = get_args(CollectiveMode)


def _collectives(value: Any, where: str) -> CollectiveMode | None:
    if value is None and "region(" in where:
        return None
    if value not in COLLECTIVE_MODES:
        raise RematUsageError(
            f"{where}: collectives must be one of {COLLECTIVE_MODES}, got {value!r}. "
            "'replay' re-issues (and verifies) the collectives on replay; 'save' "
            "keeps their outputs so the replay issues none."
        )
    return value


declare_option(
    OptionSpec(
        name="collectives",
        default="replay",
        validate=_collectives,
        doc="how collectives inside the checkpoint behave on replay",
        region=True,
        region_default=None,
    )
)
