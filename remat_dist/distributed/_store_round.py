"""Bounded rounds among the ranks of a group through the c10d store (no collective).

A round lets every rank post a short string and learn, once all have posted, the
verdict of a judge run by the last rank to arrive: ``"ok"`` or the JSON of every
rank's value. A rank that does not come within ``timeout`` makes the waiting ranks
*abort* the round: the abort is written where the verdict goes (``compare_set``, so
exactly one of verdict and abort wins), so a rank arriving late reads it at once
and raises too, and every rank's round counter stays aligned for the next round.

Keys carry the round's number. Each rank deletes its own value of two rounds ago
and the last to arrive that round's counter and verdict: every rank has left a
round two behind the one all of them have reached, so the store does not grow.

Store requests per rank and round, fault-free: an *exchange* (every rank posts a
value) costs ``set`` + ``add`` + ``wait`` + ``get`` + one delete (5); a *report*
(a count-only round: a healthy rank posts nothing but its arrival) ``add`` +
``wait`` + ``get`` (3). The last rank to arrive replaces ``wait`` + ``get`` by the
judgement (``multi_get`` for an exchange, one ``add`` for a report), a
``compare_set`` and two deletes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["RoundTimeout", "StoreRound"]

_OK = "ok"
_ABORT = "abort:"


class RoundTimeout(Exception):
    """A round did not complete in time. ``missing``: the ranks that never came
    (None where the round cannot tell); ``by``: the rank that gave up first (None:
    this one)."""

    def __init__(self, missing: list[int] | None, arrived: int, by: int | None) -> None:
        super().__init__(f"ranks {missing} did not arrive")
        self.missing = missing
        self.arrived = arrived
        self.by = by


class StoreRound:
    """Rounds among ``ranks`` (global ranks; ``rank`` is this process's) on ``store``
    (a prefix store private to these ranks). All ranks must run the same rounds in
    the same order; ``requests`` counts the store requests this rank made."""

    def __init__(self, store: Any, ranks: tuple[int, ...], rank: int) -> None:
        self.store = store
        self.ranks = ranks
        self.rank = rank
        self.seq = 0
        self.requests = 0
        self.last_round_s = 0.0

    def exchange(
        self,
        value: str,
        *,
        timeout: float,
        judge: Callable[[dict[int, str]], bool] | None = None,
    ) -> dict[int, str] | None:
        """Post ``value``; None when ``judge`` (default: values differ) finds
        nothing wrong, else every rank's value. Raises :class:`RoundTimeout`."""
        seq = self._next()
        st = self.store
        st.set(f"v/{seq}/{self.rank}", value)
        if seq >= 2:
            st.delete_key(f"v/{seq - 2}/{self.rank}")
        self.requests += 2 if seq >= 2 else 1
        judge = judge or _unequal

        def decide() -> str:
            keys = [f"v/{seq}/{r}" for r in self.ranks]
            self.requests += 1
            vals = {
                r: v.decode()
                for r, v in zip(self.ranks, st.multi_get(keys), strict=True)
            }
            return json.dumps({str(r): v for r, v in vals.items()}) if judge(vals) else _OK

        def missing() -> list[int]:
            self.requests += len(self.ranks)
            return [r for r in self.ranks if not st.check([f"v/{seq}/{r}"])]

        return self._finish(seq, timeout, decide, missing)

    def report(self, failure: str | None, *, timeout: float) -> dict[int, str] | None:
        """Count-only round: None when no rank reported a failure, else the failing
        ranks' messages. A healthy rank posts nothing but its arrival."""
        seq = self._next()
        st = self.store
        if failure is not None:
            st.set(f"m/{seq}/{self.rank}", failure)
            st.add(f"f/{seq}", 1)
            self.requests += 2

        def decide() -> str:
            self.requests += 1
            if not st.add(f"f/{seq}", 0):
                return _OK
            out = {}
            for r in self.ranks:
                key = f"m/{seq}/{r}"
                self.requests += 1
                if st.check([key]):
                    self.requests += 1
                    out[str(r)] = st.get(key).decode()
            return json.dumps(out)

        return self._finish(seq, timeout, decide, lambda: None)

    # -- the common part
    def _next(self) -> int:
        seq = self.seq
        self.seq += 1
        return seq

    def _finish(
        self,
        seq: int,
        timeout: float,
        decide: Callable[[], str],
        missing: Callable[[], list[int] | None],
    ) -> dict[int, str] | None:
        t0 = time.perf_counter()
        st = self.store
        n = len(self.ranks)
        self.requests += 1
        arrived = st.add(f"n/{seq}", 1)
        if arrived == n:
            verdict = st.compare_set(f"d/{seq}", "", decide()).decode()
            self.requests += 1
            if seq >= 2:
                st.delete_key(f"n/{seq - 2}")
                st.delete_key(f"d/{seq - 2}")
                self.requests += 2
        else:
            try:
                st.wait([f"d/{seq}"], timedelta(seconds=timeout))
                verdict = st.get(f"d/{seq}").decode()
                self.requests += 2
            except Exception:
                gone = missing()
                count = st.add(f"n/{seq}", 0)
                abort = f"{_ABORT}{self.rank}:{count}:{json.dumps(gone)}"
                verdict = st.compare_set(f"d/{seq}", "", abort).decode()
                self.requests += 3
        self.last_round_s = time.perf_counter() - t0
        if verdict.startswith(_ABORT):
            by, count, gone = verdict[len(_ABORT) :].split(":", 2)
            raise RoundTimeout(
                json.loads(gone), int(count), None if int(by) == self.rank else int(by)
            )
        if verdict == _OK:
            return None
        return {int(r): v for r, v in json.loads(verdict).items()}


def _unequal(vals: dict[int, str]) -> bool:
    return len(set(vals.values())) > 1
