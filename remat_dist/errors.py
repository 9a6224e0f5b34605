"""The exceptions remat_dist raises, for code that catches one kind.

Every error derives from :class:`remat_dist.RematError` (a ``RuntimeError``), and
misuse found at the call is a :class:`remat_dist.RematUsageError` (also a
``TypeError``); both are published at ``remat_dist``. The kinds below are raised
during replay or across ranks; ``docs/troubleshooting.md`` gives the cause and the
fix of each.
"""

from remat_dist._errors import (
    AgreementSetupError,
    CollectiveReplayError,
    PlaceholderAccessError,
    PlanMismatchError,
    RematError,
    RematUsageError,
    ReplayMismatchError,
    ReplayValueMismatchError,
)

__all__ = [
    "PlaceholderAccessError",
    "ReplayMismatchError",
    "ReplayValueMismatchError",
    "CollectiveReplayError",
    "PlanMismatchError",
    "AgreementSetupError",
]

# the two base classes are published at remat_dist; they are here too so that
# ``from remat_dist.errors import RematError`` works
_ = (RematError, RematUsageError)

# tracebacks and pickles (the test harness sends errors between ranks) name the
# kinds where users import them
for _cls in (
    PlaceholderAccessError,
    ReplayMismatchError,
    ReplayValueMismatchError,
    CollectiveReplayError,
    PlanMismatchError,
    AgreementSetupError,
):
    _cls.__module__ = __name__
del _cls
