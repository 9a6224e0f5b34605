"""The texts of the value check across ranks, and which error a report raises.

A leaf (``_step`` imports it, and it imports nothing of ``_step``'s): the value
check (``_values``) reports a replay that computed other values through the same
end-of-backward report as a replay that diverged (``_step``). When every failed
rank's message is a value mismatch, the report raises
:class:`~remat_dist.errors.ReplayValueMismatchError` (a ``CollectiveReplayError``);
otherwise ``CollectiveReplayError`` itself.
"""

from __future__ import annotations

from collections.abc import Iterable

from remat_dist._errors import CollectiveReplayError, ReplayValueMismatchError

__all__ = ["DIFFER", "collective_input_text", "report_error_class"]

DIFFER = "the replay computed other values than the forward"
"""In every value-mismatch message (the core's for saved tensors says it too)."""

FIX = (
    "The collective itself matched (op, group, shapes, dtypes), so nothing hung, "
    "but it carried other data than on forward and the gradients of this step are "
    "wrong: do not step the optimizer. Likely causes, with the fix: a data-dependent "
    "choice that is not deterministic (a top-k router with ties, a sort that is not "
    "stable, an atomic op on a GPU): make it deterministic, or keep the collective's "
    "output with collectives='save' (or its region with recompute=False) so the "
    "replay does not recompute what it sends; random numbers from a generator the "
    "state hooks do not restore: add a GeneratorStateHook for it."
)


def collective_input_text(
    rank: int,
    checkpoint: str,
    index: int,
    total: int,
    what: str,
    position: int,
    count: int,
) -> str:
    """The message of a replayed collective whose input has another fingerprint."""
    more = f" ({count} of the {total} replayed collectives differ)" if count > 1 else ""
    return (
        f"rank {rank}, checkpoint '{checkpoint}': {DIFFER}: the input of replayed "
        f"collective {index + 1} of {total} ({what}, forward ledger #{position}) has "
        f"another fingerprint than on forward{more}.\n{FIX}"
    )


def report_error_class(messages: Iterable[str]) -> type[CollectiveReplayError]:
    """``ReplayValueMismatchError`` when every failed rank's message is a value
    mismatch, ``CollectiveReplayError`` otherwise."""
    texts = [m for m in messages if m]
    if texts and all(DIFFER in m for m in texts):
        return ReplayValueMismatchError
    return CollectiveReplayError
