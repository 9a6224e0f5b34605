"""The options the distributed layer adds to ``checkpoint`` and ``region``.

Declared through the core's option seam, so the core carries them without knowing
what they mean:

* ``collectives``: how collectives inside a checkpoint (or one region) behave on
  replay: ``"replay"`` re-issues each one, checked against the forward's ledger
  before it is issued; ``"save"`` keeps their outputs on forward and issues none on
  replay. ``"verify"`` is the deprecated old name of ``"replay"``.
* ``verify_plan``: deprecated, no effect: every step's plan is agreed anyway.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from remat_dist.core import OptionSpec, declare_option
from remat_dist.errors import RematUsageError

__all__ = ["COLLECTIVE_MODES", "CollectiveMode"]

CollectiveMode = Literal["replay", "save"]
COLLECTIVE_MODES: tuple[CollectiveMode, ...] = ("replay", "save")


def _collectives(value: Any, where: str) -> CollectiveMode | None:
    if value == "verify":
        warnings.warn(
            f"{where}: collectives='verify' is deprecated: every replay is verified; "
            "pass collectives='replay'.",
            DeprecationWarning,
            stacklevel=4,
        )
        return "replay"
    if value is None and "region(" in where:
        return None
    if value not in COLLECTIVE_MODES:
        raise RematUsageError(
            f"{where}: collectives must be one of {COLLECTIVE_MODES}, got {value!r}. "
            "'replay' re-issues (and verifies) the collectives on replay; 'save' "
            "keeps their outputs so the replay issues none."
        )
    return value


def _verify_plan(value: Any, where: str) -> bool:
    if value:
        warnings.warn(
            f"{where}: verify_plan=True is deprecated and has no effect: every step's "
            "plan is agreed across ranks before backward's first collective. Drop the "
            "option (or call remat_dist.check_plan_consistency() to agree earlier).",
            DeprecationWarning,
            stacklevel=4,
        )
    return False


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
declare_option(
    OptionSpec(
        name="verify_plan",
        default=False,
        validate=_verify_plan,
        doc="deprecated, no effect",
    )
)
