"""This process's rounds with the ranks of each stake: the stake's gloo group
(made anew after a failure), a round's post and finish, the second try of a
rank that came late, and the error each rank raises for a round that failed.

``_step`` decides *when* a round runs (a graph task's agreement, its report, a
``check_plan_consistency()`` call) and what it carries; ``_stake_group`` runs one
round on one group and holds the failure protocol. This module joins the two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from remat_dist._errors import AgreementSetupError
from remat_dist._logging import get_logger
from remat_dist.distributed._plan import failure_text
from remat_dist.distributed._stake_group import (
    PostedMax,
    RoundFailure,
    StakeGroup,
    all_equal,
    check_tag,
    current_generation,
    stake_base,
    tagged_words,
)

__all__ = ["AGREE", "CHECK", "KINDS", "REPORT", "Rounds", "Stake"]

log = get_logger(__name__)

Stake = tuple[int, ...]

AGREE, REPORT, CHECK = 1, 2, 3
KINDS = {
    AGREE: "a plan agreement",
    REPORT: "an end-of-backward report",
    CHECK: "check_plan_consistency()",
}


class Rounds:
    """The rounds of this process's stakes (``rank``: its global rank; ``store``:
    the job's c10d store; ``namespace``: the store key space, the same on every
    rank). Counters for ``step_stats()``: ``operations``, ``store_requests``,
    ``groups``."""

    def __init__(self, rank: int, store: Any, namespace: str) -> None:
        self.rank = rank
        self.store = store
        self.namespace = namespace
        self.groups: dict[Stake, StakeGroup] = {}
        self.operations = 0
        self.store_requests = 0
        self.made = 0

    def post(
        self,
        stake: Stake,
        kind: int,
        words: list[int],
        explain_with: Callable[[], bytes],
        timeout: float,
    ) -> Callable[[], dict[int, bytes] | None]:
        """Post a round of ``kind`` among ``stake`` now; the returned function
        finishes it: None when every rank sent equal ``words`` (a report: when
        no rank's first word is set), else every rank's ``explain_with()`` (made
        only then). It
        raises :class:`RoundFailure` where the round failed, with ``reason="out
        of step"`` where the ranks ran rounds of different kinds."""
        tagged = tagged_words(kind, words)
        group, new = self._usable_group(stake)
        posted: PostedMax | RoundFailure
        try:
            posted = group.post_max(tagged, timeout)
        except RoundFailure as f:
            posted = f  # raised by the first try, where a late rank may retry

        def finish_first() -> list[int]:
            if isinstance(posted, RoundFailure):
                raise posted
            return posted.finish()

        def finish() -> dict[int, bytes] | None:
            got = self._run(
                stake,
                kind,
                lambda g: g.reduce_max(tagged, timeout),
                first=(group, new, finish_first),
            )
            check_tag(got, kind, stake, KINDS)
            if got[2] == 0 if kind == REPORT else all_equal(got[2:], words):
                return None
            return self._run(stake, kind, lambda g: g.gather(explain_with(), timeout))

        return finish

    def error(
        self, stake: Stake, f: RoundFailure, what: str, kind: type, timeout: float
    ) -> Exception:
        """The error every rank raises for a round that failed: ``kind`` (the
        round's own error) or, for a group that could not be set up,
        :class:`AgreementSetupError`."""
        text = failure_text(self.rank, stake, f, what, timeout)
        log.error("%s", text)
        return (AgreementSetupError if f.reason == "setup" else kind)(text)

    def last_times(self, stake: Stake) -> tuple[float, float]:
        """The last round's time from its post and the part spent waiting (s)."""
        group = self.groups.get(stake)
        return (group.last_round_s, group.last_wait_s) if group else (0.0, 0.0)

    def count(self) -> None:
        """Fold the groups' counters into this object's."""
        for group in self.groups.values():
            self._count(group)

    def close(self) -> None:
        """Drop every stake's gloo group (no store request: at exit the store may
        be gone)."""
        self.count()
        for group in self.groups.values():
            group.close()
        self.groups.clear()

    # -- groups
    def _usable_group(self, stake: Stake) -> tuple[StakeGroup, bool]:
        """The stake's group, made anew if it has none or it failed (then True)."""
        group = self.groups.get(stake)
        if group is None or group.broken:
            return self._make_group(stake, group), True
        return group, False

    def _make_group(self, stake: Stake, previous: StakeGroup | None) -> StakeGroup:
        """The stake's group of the current generation (read from the store: the
        first group, or the next after a failure)."""
        base = stake_base(self.namespace, stake)
        expected = 0 if previous is None else previous.gen + 1
        gen = current_generation(self.store, base)
        # a rank that never joined generation gen - 1 may be marked absent there
        stale = max(gen - 1, 0) if previous is None else previous.stale
        group = StakeGroup(stake, self.rank, self.store, base, gen, stale)
        group.store_requests += 1
        if gen > expected:  # its ranks gave up on a group this rank never joined
            group.missed = group.abort_of(gen - 1)
        if previous is not None:
            self._count(previous)
        self.groups[stake] = group
        self.made += 1
        return group

    def _count(self, group: StakeGroup) -> None:
        self.operations += group.rounds
        self.store_requests += group.store_requests
        group.rounds = group.store_requests = 0

    def _run(self, stake: Stake, kind: int, fn: Any, first: Any = None) -> Any:
        """Run ``fn(group)`` as this stake's next round (``first``: the group it
        was posted on, whether that group was new, and the post's finish, for the
        first try). A rank that finds an agreement or a check given up before it
        came (it took no part in it: its forward raised, or it called no check)
        runs it again on the stake's next group, where its peers meet it in their
        next round. A report is not run again: a rank reaches its report only
        after taking part in the same backward's agreement, so one late to it
        stalled in that backward; its peers dropped the step, and so does it."""
        late: RoundFailure | None = None
        for attempt in range(2):
            if attempt == 0 and first is not None:
                group, new, run = first
            else:
                group, new = self._usable_group(stake)
                run = lambda g=group: fn(g)  # noqa: E731
            if new:
                missed = group.missed
                if missed is not None and missed.reason == "setup":
                    group.missed = None  # said once: the next round runs on this group
                    raise missed
                late = late or missed
            try:
                return run()
            except RoundFailure as f:
                if late is not None:
                    f.came_late = late  # type: ignore[attr-defined]
                if not f.late or late is not None or kind == REPORT:
                    raise
                late = f
                log.info(
                    "%s of ranks %s: the ranks gave up on this round before this "
                    "rank came; running it with them in their next round",
                    KINDS[kind],
                    list(stake),
                )
            finally:
                self._count(group)
        raise AssertionError("unreachable")
