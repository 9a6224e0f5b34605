"""The rounds among the ranks of one stake, on a gloo process group of their own.

A stake's plan agreement, its end-of-backward report and a
``check_plan_consistency`` call over its ranks are each a *round*: every rank
contributes a few integers and learns their element-wise maximum (recursive
doubling on gloo's ``send``/``recv``), or, to explain a failure, every rank's
bytes (``all_gather``).

Transport: torch's gloo. The group is a ``torch.distributed.ProcessGroupGloo``
made by the stake's ranks only, on a ``PrefixStore`` of the default group's c10d
store, exactly as ``new_group(ranks, backend="gloo")`` makes its backend: the same
interface selection (``GLOO_SOCKET_IFNAME``, else the address of the host name),
name resolution and IPv6, so that wherever torch's own gloo groups reach a rank,
these rounds reach it too. The group is registered nowhere: the user's group
names, sequence numbers and ``destroy_process_group()`` are untouched, and its
collectives go to the backend directly, not through the dispatcher (so
remat_dist's own interception never sees them). Nothing of remat_dist listens on a
socket of its own; what a round trusts is what the job's store and gloo trust.

Cost: a healthy round is ``log2(n)`` exchanges of a few int64 (two more where
``n`` is no power of two), each a ``send`` and a ``recv`` that the calling thread
posts itself, and no store request. gloo's ``all_reduce`` would cost more: it is
queued to the group's worker thread and runs a ring of ``2(n-1)`` dependent hops
(0.25 against 0.09 ms between 2 processes here). The store sees a group's set-up
(gloo's rendezvous, one key per rank) and the slow or failed rounds only.

Failure. Every wait is bounded (gloo's per-operation timeout, the round's bound):

* a rank that has waited longer than ``SLOW_S`` (an eighth of the bound for
  bounds over 2 s) posts its arrival to the store (the watch thread does, while
  the exchange blocks in ``recv``: a ``recv`` waited on for less than the bound
  closes gloo's pair);
* at the bound it posts the abort (``compare_set``: the first rank to give up
  names the round and the ranks that never posted an arrival), moves the stake to
  the next generation and drops its gloo group, whose connections close: a
  partner still waiting on it fails at once, reads the abort and drops its own
  (so every member raises within its bound);
* a rank that comes to a round its peers already aborted, and that the abort
  lists as missing, took no part in it (a ``check_plan_consistency()`` called on
  one rank only, a rank that stalled past the bound): it runs its round again, on
  the next generation, where its peers meet it in their next round
  (:attr:`RoundFailure.late`). A second failure raises.

A group that failed is never used again; its generation (a counter per stake in
the store, moved by the first rank to give up) names the next one, so the ranks
of a stake meet on the same new group however they learnt of the failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from math import inf
from typing import Any, NamedTuple

import torch

from remat_dist._logging import get_logger

__all__ = [
    "PostedMax",
    "RoundFailure",
    "StakeGroup",
    "all_equal",
    "check_tag",
    "tagged_words",
]

log = get_logger(__name__)

SLOW_S = 0.25
"""The shortest wait after which a rank posts its arrival to the store and looks
there for an abort; a round whose bound is over 2 s waits an eighth of it (a
healthy group arrives within milliseconds; a loaded machine should not turn
every round into store traffic)."""


class RoundFailure(Exception):
    """A round, or the set-up of its group, did not complete on this rank.

    ``reason``: ``"timeout"`` (this rank gave up), ``"aborted"`` (rank ``by`` gave
    up first), ``"closed"`` (a partner's connection closed with no abort posted:
    it exited or died), ``"out of step"`` (the ranks ran different rounds),
    ``"setup"`` (the gloo group could not be made: ``detail`` says who could not
    reach whom). ``missing``: the ranks that never arrived, where known.
    ``late``: the round was aborted before this rank came to it (it is listed
    missing), so this rank took no part in it and may run its round again on the
    next generation.
    """

    def __init__(
        self,
        reason: str,
        detail: str,
        *,
        missing: list[int] | None = None,
        by: int | None = None,
        late: bool = False,
    ) -> None:
        super().__init__(detail)
        self.reason = reason
        self.missing = missing
        self.by = by
        self.late = late


class StakeGroup:
    """One generation of a stake's gloo group and the rounds on it.

    ``ranks``: the stake's sorted global ranks (``rank`` is this process's);
    ``base``: the stake's key in ``store`` (the same on every member); the group
    of generation ``gen`` lives under ``{base}/{gen}``. Every member must run the
    same rounds in the same order. Counters: ``rounds``, ``store_requests``,
    ``last_round_s`` (from the round's post to its end), ``last_wait_s`` (the
    part spent in :meth:`PostedMax.finish`).
    """

    def __init__(
        self, ranks: Sequence[int], rank: int, store: Any, base: str, gen: int
    ) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.ranks = tuple(ranks)
        self.rank = rank
        self.index = self.ranks.index(rank)
        self.store = store
        self.base = base
        self.gen = gen
        self.key = f"{base}/{gen}"
        self.seq = 0
        self.rounds = 0
        self.store_requests = 0
        self.last_round_s = 0.0
        self.last_wait_s = 0.0
        self.broken = False
        self._pg: Any = None
        self._posted: list[str] = []
        self._store_lock = threading.Lock()
        self.missed: RoundFailure | None = None
        """The abort of an earlier generation this rank never took part in (its
        ranks gave up on it before this rank came), where one is known."""

    # -- set-up: at the first round, so that a stake costs nothing until it agrees
    def _group(self, timeout: float) -> Any:
        if self._pg is not None:
            return self._pg
        dist = self._dist
        abort = self._read_abort()
        if abort is not None:  # its ranks gave up on it before this rank came
            raise self._aborted(abort)
        self._post(f"{self.key}/here/{self.index}", _where())
        made: dict[str, Any] = {}

        def make() -> None:
            try:
                made["pg"] = dist.ProcessGroupGloo(
                    dist.PrefixStore(f"{self.key}/gloo", self.store),
                    self.index,
                    len(self.ranks),
                    timedelta(seconds=timeout),
                )
            except RuntimeError as e:
                made["error"] = e

        # gloo's rendezvous may wait longer than the bound where a peer cannot
        # reach this rank (its dials are retried): it runs on a thread of its
        # own while this one watches the store for a peer's abort and the bound
        maker = threading.Thread(
            target=make, name="remat_dist-stake-setup", daemon=True
        )
        maker.start()
        every = _every(timeout)
        deadline = time.monotonic() + timeout
        while True:
            maker.join(every)
            if not maker.is_alive():
                break
            abort = self._read_abort()
            if abort is not None:
                raise self._aborted(abort)
            if time.monotonic() >= deadline:
                if self._absent("here"):
                    raise self._give_up(_SETUP, timeout)
                stalled = RuntimeError(
                    f"its connections did not complete within {timeout:g} s"
                )
                raise self._setup_failure(stalled, timeout)
        if "error" in made:
            raise self._setup_failure(made["error"], timeout) from None
        self._pg = made["pg"]
        return self._pg

    def _setup_failure(self, error: RuntimeError, timeout: float) -> RoundFailure:
        """gloo's rendezvous failed: the ranks that never came (no ``here`` key)
        are missing; if every rank came, some could not connect (the first rank
        to find it posts why, for the others to say too). An error of this rank's
        own (an interface gloo cannot use) is a set-up failure whoever came."""
        text = str(error).lower()
        if ("timed out" in text or "timeout" in text) and self._absent("here"):
            return self._give_up(_SETUP, timeout)
        where = {}
        for i, r in enumerate(self.ranks):
            got = self._quiet("get", f"{self.key}/here/{i}")
            where[r] = got.decode() if got else "?"
        peers = "; ".join(f"rank {r}: {w}" for r, w in sorted(where.items()))
        why = (
            f"rank {self.rank} could not connect the gloo group of ranks "
            f"{list(self.ranks)}: every rank came, but gloo said: "
            f"{_first_line(error)}. Where each rank's gloo listens: {peers}. Fix: "
            "make every rank reach the others over the interface gloo picks: set "
            "GLOO_SOCKET_IFNAME to the interface that joins the hosts (the one "
            "torch's own gloo groups use), or map this host's name to a reachable "
            "address in /etc/hosts (not 127.0.1.1), and allow TCP between the "
            "hosts on gloo's ports"
        )
        self._quiet("compare_set", f"{self.key}/why", "", why)
        won = self._post_abort(_SETUP, [])
        if won is not None and won[1] != self.rank:
            return self._aborted(won)
        return RoundFailure("setup", why)

    # -- rounds
    def post_max(self, values: Sequence[int], timeout: float) -> PostedMax:
        """Start a round that makes ``values`` (int64, the same length everywhere)
        the element-wise maximum over the members: set the group up if this is
        its first round, post the first exchange and return without waiting.
        :meth:`PostedMax.finish` completes it. Where every member posts before
        any finishes, the first exchange (the whole round at 2 ranks) travels
        while the members compute."""
        seq = self._next_operation()
        try:
            return PostedMax(self, self._group(timeout), seq, values, timeout)
        except BaseException:
            self._fail()
            raise

    def reduce_max(self, values: Sequence[int], timeout: float) -> list[int]:
        """:meth:`post_max` and its finish, at once."""
        return self.post_max(values, timeout).finish()

    def gather(self, payload: bytes, timeout: float) -> dict[int, bytes]:
        """Every member's ``payload``, by global rank (the longest length, then the
        padded bytes in one ``all_gather``: the slow path, to explain a failure)."""
        n = self.reduce_max([len(payload)] + [0] * (_WORDS - 1), timeout)[0]
        head = len(payload).to_bytes(4, "big") + payload
        mine = torch.zeros(n + 4, dtype=torch.uint8)
        mine[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        outs = [torch.empty_like(mine) for _ in self.ranks]
        seq = self._next_operation()
        t0 = time.monotonic()
        try:
            work = self._group(timeout).allgather(outs, mine, timedelta(seconds=timeout))
            self._wait(work, _Round(seq, t0 + timeout, timeout))
        except BaseException:
            self._fail()
            raise
        self.last_round_s = time.monotonic() - t0
        got = {}
        for r, t in zip(self.ranks, outs, strict=True):
            raw = t.numpy().tobytes()
            got[r] = raw[4 : 4 + int.from_bytes(raw[:4], "big")]
        return got

    def _next_operation(self) -> int:
        """Number the next operation of a round (all members number alike)."""
        if self.broken:
            raise RoundFailure("closed", "this group failed earlier")
        self.seq += 1
        self.rounds += 1
        return self.seq - 1

    def exchanges(self) -> list[_Exchange]:
        """This member's exchanges of a max round, by recursive doubling: members
        past the largest power of two ``p`` fold into member ``index - p`` and get
        the result back; the first ``p`` swap with member ``index ^ d`` for
        ``d = 1, 2, 4, ...``. ``log2(p)`` exchanges, two more where the count is
        not a power of two (gloo's ``all_reduce`` would be queued to its worker
        thread and run a ring of ``2(n-1)`` hops)."""
        n, i = len(self.ranks), self.index
        p = 1 << (n.bit_length() - 1)
        if i >= p:
            return [_Exchange(i - p, send=0, recv=1, combine=torch.Tensor.copy_)]
        steps = []
        if i + p < n:
            steps.append(_Exchange(i + p, send=None, recv=0, combine=_maximum))
        d, tag = 1, 2
        while d < p:
            steps.append(_Exchange(i ^ d, send=tag, recv=tag, combine=_maximum))
            d, tag = d * 2, tag + 1
        if i + p < n:
            steps.append(_Exchange(i + p, send=1, recv=None, combine=None))
        return steps

    def _wait(self, work: Any, rnd: _Round) -> None:
        """Wait for an operation of gloo's worker thread (``all_gather``): waits of
        ``every`` seconds, posting the arrival and reading the abort between them."""
        seq, end, timeout = rnd
        every = _every(timeout)
        posted = False
        while True:
            try:
                work.wait(timedelta(seconds=every))
                return
            except RuntimeError as e:
                if str(e) != _STILL_WAITING:  # gloo's own error
                    raise self._gloo_failure(e, seq, timeout) from None
            if time.monotonic() > end + 2 * every:  # gloo should have raised
                _RETIRED.append((self._pg, work))
                self._pg = None
                raise self._give_up(seq, timeout)
            if not posted:
                self.post_arrival(seq)
                posted = True
            abort = self._read_abort()
            if abort is not None:
                _RETIRED.append((self._pg, work))  # its op ends at gloo's timeout
                self._pg = None
                raise self._aborted(abort)

    def post_arrival(self, seq: int) -> None:
        """Say in the store that this rank came to round ``seq`` (a rank that gives
        up names those that did not)."""
        self._post(f"{self.key}/arr/{seq}/{self.index}", "1")

    def _spent(self, error: RuntimeError, seq: int, timeout: float) -> RoundFailure:
        """gloo raised in round ``seq``: what failed, after which the group is
        spent."""
        failure = self._gloo_failure(error, seq, timeout)
        self._fail()
        return failure

    def _gloo_failure(
        self, error: RuntimeError, seq: int, timeout: float
    ) -> RoundFailure:
        if "timed out" in str(error).lower():
            return self._give_up(seq, timeout)
        # a partner's connection closed: it gave up (read why) or went away
        abort = self._read_abort(grace=min(1.0, SLOW_S * 4))
        if abort is not None:
            return self._aborted(abort)
        return RoundFailure(
            "closed",
            f"a partner's connection closed in {_round_text(seq)} with no abort "
            f"posted: it exited or died (gloo said: {_first_line(error)})",
        )

    def _give_up(self, seq: int, timeout: float) -> RoundFailure:
        """The bound passed on this rank: post the abort naming the ranks that
        never arrived, or read the one another rank posted first."""
        missing = self._absent("here" if seq == _SETUP else f"arr/{seq}")
        won = self._post_abort(seq, missing)
        if won is not None and won[1] != self.rank:
            return self._aborted(won)
        what = (
            f"the gloo group of ranks {list(self.ranks)} was not set up"
            if seq == _SETUP
            else f"{_round_text(seq)} did not complete"
        )
        return RoundFailure("timeout", f"{what} within {timeout:g} s", missing=missing)

    # -- the store, on set-up and slow paths only
    def _quiet(self, op: str, *args: Any) -> Any:
        """A store request; None where the store is gone too (the job ends)."""
        with self._store_lock:  # the watch thread posts arrivals too
            self.store_requests += 1
            try:
                return getattr(self.store, op)(*args)
            except Exception:  # noqa: BLE001
                return None

    def _post(self, key: str, value: str) -> None:
        self._quiet("set", key, value)
        self._posted.append(key)

    def _read_abort(self, grace: float = 0.0) -> tuple[int, int, list[int]] | None:
        key = f"{self.key}/abort"
        end = time.monotonic() + grace
        while True:
            if self._quiet("check", [key]):
                got = self._quiet("get", key)
                return None if got is None else _parse_abort(got)
            if time.monotonic() >= end:
                return None
            time.sleep(0.02)

    def _absent(self, kind: str) -> list[int]:
        """The other members without a ``{kind}/{index}`` key (set-up: ``here``;
        an arrival in round ``seq``: ``arr/{seq}``)."""
        return [
            r
            for i, r in enumerate(self.ranks)
            if i != self.index and not self._quiet("check", [f"{self.key}/{kind}/{i}"])
        ]

    def _post_abort(
        self, seq: int, missing: list[int]
    ) -> tuple[int, int, list[int]] | None:
        """Post this generation's abort (the first rank's wins: returned) and
        move the stake to the next generation."""
        mine = f"{seq}:{self.rank}:{json.dumps(missing)}"
        won = self._quiet("compare_set", f"{self.key}/abort", "", mine)
        expected = "" if self.gen == 0 else str(self.gen)
        self._quiet("compare_set", f"{self.base}/gen", expected, str(self.gen + 1))
        return None if won is None else _parse_abort(won)

    def _aborted(self, abort: tuple[int, int, list[int]]) -> RoundFailure:
        """The failure of a round that rank ``abort[1]`` gave up on first (a
        set-up that could not connect: its words)."""
        if abort[0] == _SETUP and not abort[2]:
            why = self._quiet("get", f"{self.key}/why")
            return RoundFailure("setup", why.decode() if why else "the set-up failed")
        return _aborted(abort, self.rank)

    def abort_of(self, gen: int) -> RoundFailure | None:
        """The abort of the stake's generation ``gen`` as this rank would have met
        it, where it names this rank among the missing."""
        got = (
            self._quiet("get", f"{self.base}/{gen}/abort")
            if self._quiet("check", [f"{self.base}/{gen}/abort"])
            else None
        )
        if got is None:
            return None
        failure = _aborted(_parse_abort(got), self.rank)
        return failure if failure.late else None

    # -- teardown
    def close(self) -> None:
        """Drop the gloo group (its connections close: partners see it at once);
        the group is spent. No store request: at exit the store may be gone."""
        self.broken = True
        self._pg = None

    def _fail(self) -> None:
        """A round or the set-up failed here: take back this rank's keys of this
        generation (its ``here`` and arrivals; the abort stays for late ranks),
        then close."""
        for key in self._posted:
            self._quiet("delete_key", key)
        self._posted.clear()
        self.close()


def current_generation(store: Any, base: str) -> int:
    """The generation a stake's ranks meet on (0 until a round of it failed)."""
    try:
        if store.check([f"{base}/gen"]):
            return int(store.get(f"{base}/gen").decode())
    except Exception:  # noqa: BLE001 - no store: nothing failed that we can see
        pass
    return 0


class _Round(NamedTuple):
    """One operation of a round: its number, when its bound ends (monotonic) and
    the bound."""

    seq: int
    end: float
    timeout: float

    def left(self) -> timedelta:
        """What is left of the bound, for a gloo wait (at least 1 ms)."""
        return timedelta(seconds=max(self.end - time.monotonic(), 0.001))


class _Exchange(NamedTuple):
    """One exchange of a max round with member ``peer``: the tags of this
    member's ``send`` and ``recv`` (None: not that way), and how the received
    words join this member's (``combine(mine, got)``)."""

    peer: int
    send: int | None
    recv: int | None
    combine: Callable[[torch.Tensor, torch.Tensor], Any] | None


def _maximum(mine: torch.Tensor, got: torch.Tensor) -> None:
    torch.maximum(mine, got, out=mine)


class PostedMax:
    """A max round whose first exchange is posted (:meth:`StakeGroup.post_max`).

    Every ``send``/``recv`` is posted from the calling thread and each ``recv``
    is waited on once, to the bound (a shorter wait closes gloo's pair), so the
    arrival of a rank that waits long is posted by the watch thread. The bound
    runs from :meth:`finish`, where this rank starts to wait, not from the post:
    what the rank computes in between is not a wait."""

    def __init__(
        self, group: StakeGroup, pg: Any, seq: int, values: Sequence[int], timeout: float
    ) -> None:
        self.group, self.pg, self.seq, self.timeout = group, pg, seq, timeout
        self.mine = torch.tensor(values, dtype=torch.int64)
        self.got = torch.empty_like(self.mine)
        self.steps = group.exchanges()
        self.t0 = time.monotonic()
        self.first = self._post(self.steps[0]) if self.steps else ()

    def _post(self, step: _Exchange) -> tuple[Any, ...]:
        try:
            sent = () if step.send is None else (self.pg.send([self.mine], step.peer, step.send),)
            got = () if step.recv is None else (self.pg.recv([self.got], step.peer, step.recv),)
        except RuntimeError as e:
            raise self.group._spent(e, self.seq, self.timeout) from None
        return got + sent

    def finish(self) -> list[int]:
        """Complete the round (the remaining exchanges, each posted and waited in
        turn); the element-wise maximum."""
        group = self.group
        start = time.monotonic()
        rnd = _Round(self.seq, start + self.timeout, self.timeout)
        _ARRIVALS.enter(group, rnd)
        try:
            for k, step in enumerate(self.steps):
                works = self.first if k == 0 else self._post(step)
                for work in works:
                    work.wait(rnd.left())
                if step.combine is not None:
                    step.combine(self.mine, self.got)
        except RuntimeError as e:
            raise group._spent(e, self.seq, self.timeout) from None
        except BaseException:
            group._fail()
            raise
        finally:
            _ARRIVALS.leave(group)
        end = time.monotonic()
        group.last_round_s, group.last_wait_s = end - self.t0, end - start
        return self.mine.tolist()


def _every(timeout: float) -> float:
    """How long a rank waits in a round before it posts its arrival."""
    return min(timeout / 4, max(SLOW_S, timeout / 8))


class _ArrivalWatch:
    """Posts the arrival of a rank that waits long in a round's exchange.

    The exchange blocks in gloo's ``recv`` for the whole bound (a shorter wait
    closes gloo's pair), so the post is made by this one daemon thread: it sleeps
    while no round waits, wakes once per round at most (at its ``every`` mark) and
    posts if that round is still waiting. A healthy round costs the calling thread
    two dictionary updates under a lock, and a wake-up of the thread only where
    it sleeps past the round's mark (the first round after an idle spell)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._waiting: dict[int, tuple[StakeGroup, int, float]] = {}
        self._next = float("inf")
        """When the thread wakes next (inf: it sleeps until a round comes)."""
        self._thread: threading.Thread | None = None

    def enter(self, group: StakeGroup, rnd: _Round) -> None:
        due = time.monotonic() + _every(rnd.timeout)
        with self._lock:
            self._waiting[id(group)] = (group, rnd.seq, due)
            if due < self._next:  # the thread sleeps past this round's mark
                self._next = due
                self._wake.set()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="remat_dist-arrivals", daemon=True
                )
                self._thread.start()

    def leave(self, group: StakeGroup) -> None:
        with self._lock:
            self._waiting.pop(id(group), None)

    def _loop(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                due = [w for w in self._waiting.values() if w[2] <= now]
                for group, _, _ in due:
                    self._waiting.pop(id(group), None)
                self._next = min((w[2] for w in self._waiting.values()), default=inf)
                self._wake.clear()
            for group, seq, _ in due:
                group.post_arrival(seq)
            nxt = self._next
            self._wake.wait(None if nxt == inf else max(nxt - time.monotonic(), 0))


_ARRIVALS = _ArrivalWatch()


_RETIRED: list[tuple[Any, Any]] = []
"""Groups dropped while an operation of theirs was still pending (the abort was
read from the store before gloo's timeout): a gloo group's destructor waits for
its pending operations, so they are released once those have ended."""


def release_retired(wait: bool = False) -> None:
    """Release the retired groups whose pending operation ended (all of them,
    waiting for their operations, with ``wait``)."""
    keep = []
    for pg, work in _RETIRED:
        if wait or work.is_completed():
            try:
                work.wait()
            except RuntimeError:
                pass
        else:
            keep.append((pg, work))
    _RETIRED[:] = keep


_WORDS = 6
"""Every ``all_reduce`` of a round carries this many int64 (a tagged digest: the
tag, its negation, two words and theirs): ranks that ran different rounds still
issue operations of one shape, and the tags tell them apart."""

_SETUP = -1
"""The round number of a group's set-up (in keys: ``here``)."""
_STILL_WAITING = "Operation timed out!"
"""What ``Work.wait(timeout)`` raises while the operation is still running."""


def _round_text(seq: int) -> str:
    return "the group's set-up" if seq == _SETUP else f"round {seq}"


def _parse_abort(raw: bytes) -> tuple[int, int, list[int]]:
    seq, by, missing = raw.decode().split(":", 2)
    return int(seq), int(by), json.loads(missing)


def _aborted(abort: tuple[int, int, list[int]], rank: int) -> RoundFailure:
    a_seq, by, missing = abort
    return RoundFailure(
        "aborted",
        f"rank {by} gave up waiting in {_round_text(a_seq)}",
        missing=missing,
        by=by,
        late=rank in missing,
    )


def _where() -> str:
    """Where this rank's gloo listens, as gloo picks it (for set-up errors)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    host = socket.gethostname()
    if ifname:
        return f"{host}, interface {ifname} (GLOO_SOCKET_IFNAME)"
    try:
        addr = socket.getaddrinfo(host, None)[0][4][0]
    except OSError:
        addr = "unresolved"
    return f"host name {host!r} -> {addr} (no GLOO_SOCKET_IFNAME)"


def _first_line(error: BaseException) -> str:
    return (
        str(error).strip().splitlines()[0][:300]
        if str(error).strip()
        else type(error).__name__
    )


def stake_base(namespace: str, ranks: Sequence[int]) -> str:
    """The store key of a stake (its ranks hashed: world-sized stakes stay short)."""
    digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
    return f"remat_dist/g/{namespace}/{digest}"


# ---------------------------------------------------- equality by one max-reduce


def tagged_words(tag: int, words: list[int]) -> list[int]:
    """``words`` and their negations behind a round tag: after a max-reduce, the
    ranks sent equal words exactly when each word equals minus its negation's max
    (:func:`all_equal`), and the tag says which kind of round every rank ran."""
    return [tag, -tag, *words, *(-w for w in words)]


def check_tag(
    got: list[int], tag: int, stake: tuple[int, ...], kinds: dict[int, str]
) -> None:
    if got[0] != tag or -got[1] != tag:
        ran = " and ".join(kinds.get(k, "?") for k in sorted({got[0], -got[1]}))
        raise RoundFailure(
            "out of step",
            f"the ranks of {list(stake)} ran different rounds ({ran}): they ran "
            "another number of steps, a step raised on some ranks only, or "
            "check_plan_consistency() was called on some ranks only",
        )


def all_equal(got: list[int], words: list[int]) -> bool:
    n = len(words)
    return all(got[i] == -got[n + i] for i in range(n))
