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
operations go to the backend directly, not through the dispatcher (so
remat_dist's own interception never sees them). Nothing of remat_dist listens on
a socket of its own, and no thread of it runs in the background but gloo's
rendezvous while a group is set up.

Cost: a healthy round is ``log2(n)`` exchanges of a few int64 (two more where
``n`` is no power of two), each a ``send`` and a ``recv`` that the calling thread
posts itself, and no store request, however long the ranks take to come. The
store sees a group's set-up (gloo's rendezvous: one key per rank, and one
``here`` key per rank naming where its gloo listens) and failed rounds only.

Failure (``docs/distributed.md`` draws it as a state machine). Every wait is
bounded by the round's bound. A rank whose wait ends without the round
completing (the bound passed, or a partner's connection closed) *gives up*:

1. it posts the generation's abort (``compare_set``: the first rank's stands;
   it names the round and who gave up) and drops its gloo group, whose
   connections close: every partner still waiting fails at once;
2. a rank that fails and finds an abort *claims* the round: it sets its claim
   key to ``in`` (``compare_set``, so a claim and a mark never both win);
3. the rank whose abort stood waits for the claims (at 2 ranks a short grace:
   the other member waits on this rank's connection, which just closed; past 2
   ranks one more bound, since a member may wait on another partner until its
   own bound), then marks every member without one ``out`` (``compare_set``)
   and posts the list of those marked: the ranks that never came;
4. a rank that finds its claim marked ``out`` took no part in the round (it came
   after its peers gave up, as a ``check_plan_consistency()`` called on the
   other ranks only): :attr:`RoundFailure.late`; the caller runs its round
   again on the stake's next group, where its peers meet it in their next round.

The first rank to give up also moves the stake to the next generation (a
counter in the store), so every member meets on the same new group however it
learnt of the failure. Every decision is one atomic store operation that every
member reads alike: a claim and a mark cannot both succeed. Errors are told
apart by the store and the clock, never by gloo's message text: an abort in the
store means a peer gave up; none, at the bound, means this rank gives up; none
before it means a partner closed its connection unannounced (it exited or died).
A generation's keys are taken back by its members at the first round that
completes on the next one, when no member can need them any more.
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

GRACE_S = 0.5
"""How long the rank whose abort stood waits for the members still in the round
to claim it before it marks the others absent. Members blocked in the round
learn of the abort at once (their connections close), so this only decides the
ranks that come just as their peers give up."""

_SETUP = -1
"""The round number of a group's set-up (its claim key is ``here``)."""


class RoundFailure(Exception):
    """A round, or the set-up of its group, did not complete on this rank.

    ``reason``: ``"timeout"`` (this rank gave up at the bound), ``"aborted"``
    (rank ``by`` gave up first), ``"closed"`` (a partner's connection closed with
    no abort posted: it exited or died), ``"out of step"`` (the ranks ran
    different rounds), ``"setup"`` (the gloo group could not be made: the text
    says who could not reach whom). ``missing``: the ranks that never came to the
    round, where known. ``late``: this rank came after its peers had given up on
    the round (it is marked absent), so it took no part in it and may run its
    round again on the next generation.
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


class _Abort(NamedTuple):
    """A generation's abort as the store holds it."""

    seq: int
    by: int
    reason: str

    def encode(self) -> str:
        return f"{self.seq}:{self.by}:{self.reason}"

    @staticmethod
    def decode(raw: bytes) -> _Abort:
        seq, by, reason = raw.decode().split(":", 2)
        return _Abort(int(seq), int(by), reason)


class StakeGroup:
    """One generation of a stake's gloo group and the rounds on it.

    ``ranks``: the stake's sorted global ranks (``rank`` is this process's);
    ``base``: the stake's key in ``store`` (the same on every member); the group
    of generation ``gen`` lives under ``{base}/{gen}``. ``stale``: the oldest
    earlier generation whose keys this member has not taken back (they are, at
    this group's first completed round). Every member must run the same rounds
    in the same order. Counters: ``rounds``, ``store_requests``,
    ``last_round_s`` (from the round's post to its end), ``last_wait_s`` (the
    part spent in :meth:`PostedMax.finish`).
    """

    def __init__(
        self,
        ranks: Sequence[int],
        rank: int,
        store: Any,
        base: str,
        gen: int,
        stale: int | None = None,
    ) -> None:
        self.ranks = tuple(ranks)
        self.rank = rank
        self.index = self.ranks.index(rank)
        self.store = store
        self.base = base
        self.gen = gen
        self.key = f"{base}/{gen}"
        self.stale = gen if stale is None else stale
        self.seq = 0
        self.bound = 0.0
        """The bound of the current operation (seconds)."""
        self.rounds = 0
        self.store_requests = 0
        self.last_round_s = 0.0
        self.last_wait_s = 0.0
        self.broken = False
        self._pg: Any = None
        self.missed: RoundFailure | None = None
        """The abort of an earlier generation this rank never took part in (its
        ranks gave up on it before this rank came), where one is known."""

    # -- set-up: at the first round, so that a stake costs nothing until it agrees
    def _group(self, timeout: float) -> Any:
        if self._pg is not None:
            return self._pg
        import torch.distributed as dist

        abort = self._read_abort()
        if abort is not None:  # its ranks gave up on it before this rank came
            raise self._learn(abort)
        claimed = self._quiet("compare_set", self._claim(_SETUP, self.index), "", _where())
        if claimed == b"out":
            raise self._learn(self._read_abort() or _Abort(_SETUP, -1, "timeout"))
        deadline = time.monotonic() + timeout
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

        # gloo retries its dials past its timeout where a peer's address cannot
        # be reached: the rendezvous runs on a thread of its own (the only one
        # remat_dist starts, and only while a group is set up), so that this
        # rank gives up at the bound
        maker = threading.Thread(target=make, name="remat_dist-setup", daemon=True)
        maker.start()
        maker.join(timeout)
        if maker.is_alive():
            stalled = RuntimeError(f"its connections did not complete within {timeout:g} s")
            raise self._setup_failed(stalled, deadline)
        if "error" in made:
            raise self._setup_failed(made["error"], deadline) from None
        self._pg = made["pg"]
        return self._pg

    def _setup_failed(self, error: RuntimeError, deadline: float) -> RoundFailure:
        """gloo's rendezvous failed: a peer gave up (its abort), some never came
        (the bound passed with members unclaimed), or every rank came and some
        could not connect (the first rank to find it posts why, for the others
        to say too). An error of this rank's own (an interface gloo cannot use)
        is a set-up failure whoever came."""
        abort = self._read_abort()
        if abort is not None:
            return self._learn(abort)
        if time.monotonic() >= deadline and self._unclaimed(_SETUP):
            return self._give_up(_SETUP, "timeout", deadline)
        where = {}
        for i, r in enumerate(self.ranks):
            got = self._quiet("get", self._claim(_SETUP, i)) if self._has(
                self._claim(_SETUP, i)
            ) else None
            where[r] = got.decode() if got else "did not come"
        peers = "; ".join(f"rank {r}: {w}" for r, w in sorted(where.items()))
        why = (
            f"rank {self.rank} could not connect the gloo group of ranks "
            f"{list(self.ranks)}: gloo said: {_first_line(error)}. Where each "
            f"rank's gloo listens: {peers}. Fix: make every rank reach the others "
            "over the interface gloo picks: set GLOO_SOCKET_IFNAME to the interface "
            "that joins the hosts (the one torch's own gloo groups use), or map "
            "this host's name to a reachable address in /etc/hosts (not "
            "127.0.1.1), and allow TCP between the hosts on gloo's ports"
        )
        self._quiet("compare_set", f"{self.key}/why", "", why)
        return self._give_up(_SETUP, "setup", deadline)

    # -- rounds
    def post_max(self, values: Sequence[int], timeout: float) -> PostedMax:
        """Start a round that makes ``values`` (int64, the same length everywhere)
        the element-wise maximum over the members: set the group up if this is
        its first round, post the first exchange and return without waiting.
        :meth:`PostedMax.finish` completes it. Where every member posts before
        any finishes, the first exchange (the whole round at 2 ranks) travels
        while the members compute."""
        seq = self._next_operation(timeout)
        try:
            return PostedMax(self, self._group(timeout), seq, values, timeout)
        except BaseException:
            self.close()
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
        seq = self._next_operation(timeout)
        t0 = time.monotonic()
        try:
            # gloo ends the operation itself at its timeout
            bound = timedelta(seconds=timeout)
            self._group(timeout).allgather(outs, mine, bound).wait(bound)
        except RuntimeError as e:
            raise self._failed(seq, t0 + timeout) from e
        except BaseException:
            self.close()
            raise
        self._completed()
        self.last_round_s = time.monotonic() - t0
        got = {}
        for r, t in zip(self.ranks, outs, strict=True):
            raw = bytes(t.tolist())
            got[r] = raw[4 : 4 + int.from_bytes(raw[:4], "big")]
        return got

    def _next_operation(self, timeout: float) -> int:
        """Number the next operation of a round (all members number alike)."""
        if self.broken:
            raise RoundFailure("closed", "this group failed earlier")
        self.bound = timeout
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

    def _completed(self) -> None:
        """A round completed on this group: every member has left the earlier
        generations behind, so this member takes back its keys of them."""
        if self.stale < self.gen:
            self._take_back(self.stale, self.gen)
            self.stale = self.gen

    # -- failure: the abort, claims and marks (module docstring)
    def _failed(self, seq: int, deadline: float) -> RoundFailure:
        """Round ``seq`` did not complete here (gloo raised): a peer's abort is
        learnt; without one, this rank gives up (at the bound: ``timeout``;
        before it: a partner closed its connection unannounced)."""
        abort = self._read_abort()
        if abort is not None:
            return self._learn(abort)
        # gloo ends a wait at its timeout in whole milliseconds
        reason = "timeout" if time.monotonic() >= deadline - 0.05 else "closed"
        return self._give_up(seq, reason, deadline)

    def _give_up(self, seq: int, reason: str, deadline: float) -> RoundFailure:
        """Post the abort of this generation; where it stands, close the group,
        wait the grace for the members still in the round to claim it, mark the
        others absent and post them; else learn the abort that stood."""
        mine = _Abort(seq, self.rank, reason).encode()
        stood = self._quiet("compare_set", f"{self.key}/abort", "", mine)
        self._next_generation()
        if stood is None:  # the store is gone: the job is ending
            self.close()
            return RoundFailure(reason, f"{_round_text(seq)} failed and the store is gone")
        abort = _Abort.decode(stood)
        if abort.by != self.rank or abort.seq != seq:
            return self._learn(abort)
        self.close()  # partners waiting on this group fail at once
        missing = self._mark_absent(seq)
        self._quiet("set", f"{self.key}/missing", json.dumps(missing))
        if reason == "setup":
            why = self._quiet("get", f"{self.key}/why")
            return RoundFailure("setup", why.decode() if why else "the set-up failed")
        what = (
            f"the gloo group of ranks {list(self.ranks)} was not set up"
            if seq == _SETUP
            else f"{_round_text(seq)} did not complete"
        )
        if reason == "closed":
            return RoundFailure(
                "closed",
                f"a partner's connection closed in {_round_text(seq)} without "
                "giving up first: it exited or died",
                missing=missing,
            )
        return RoundFailure("timeout", f"{what} within the bound", missing=missing)

    def _learn(self, abort: _Abort) -> RoundFailure:
        """A peer's abort of this generation stands: claim its round (or find this
        rank marked absent: late), close the group, read who never came."""
        got = self._quiet("compare_set", self._claim(abort.seq, self.index), "", "in")
        late = got == b"out"
        self.close()
        missing = self._read_missing()
        if abort.reason == "setup":  # a rank could not connect: late or not
            why = self._quiet("get", f"{self.key}/why")
            return RoundFailure("setup", why.decode() if why else "the set-up failed")
        return RoundFailure(
            "aborted",
            f"rank {abort.by} gave up waiting in {_round_text(abort.seq)}",
            missing=missing,
            by=abort.by,
            late=late,
        )

    def _claim_wait(self) -> float:
        """How long the members of a failed round may take to claim it. At 2
        ranks the other member waits on this rank's connection, which closes with
        the abort: it learns at once. Past 2 ranks a member may wait on another
        partner's connection until its own bound."""
        return GRACE_S if len(self.ranks) == 2 else self.bound + GRACE_S

    def _mark_absent(self, seq: int) -> list[int]:
        """Once every other member claimed round ``seq`` or the claim wait passed,
        mark those that did not absent; the members so marked."""
        others = [i for i in range(len(self.ranks)) if i != self.index]
        end = time.monotonic() + self._claim_wait()
        while time.monotonic() < end and not all(
            self._has(self._claim(seq, i)) for i in others
        ):
            time.sleep(0.01)
        missing = []
        for i in others:
            got = self._quiet("compare_set", self._claim(seq, i), "", "out")
            if got == b"out":
                missing.append(self.ranks[i])
        return missing

    def _read_missing(self) -> list[int] | None:
        """The members the giver marked absent (None: it did not post them within
        the grace and a second: it died too)."""
        key = f"{self.key}/missing"
        end = time.monotonic() + self._claim_wait() + 1.0
        while True:
            if self._has(key):
                got = self._quiet("get", key)
                return None if got is None else json.loads(got.decode())
            if time.monotonic() >= end:
                return None
            time.sleep(0.01)

    def _next_generation(self) -> None:
        expected = "" if self.gen == 0 else str(self.gen)
        self._quiet("compare_set", f"{self.base}/gen", expected, str(self.gen + 1))

    def abort_of(self, gen: int) -> RoundFailure | None:
        """The abort of the stake's generation ``gen`` as this rank would have met
        it, where it marks this rank absent or the set-up failed (None
        otherwise)."""
        key = f"{self.base}/{gen}/abort"
        raw = self._quiet("get", key) if self._has(key) else None
        if raw is None:
            return None
        abort = _Abort.decode(raw)
        if abort.reason == "setup":  # a rank could not connect: every rank says so
            why_key = f"{self.base}/{gen}/why"
            why = self._quiet("get", why_key) if self._has(why_key) else None
            return RoundFailure("setup", why.decode() if why else "the set-up failed")
        mine = f"{self.base}/{gen}/{_claim_name(abort.seq)}/{self.index}"
        if self._quiet("compare_set", mine, "", "in") != b"out":
            return None
        missing_key = f"{self.base}/{gen}/missing"
        missing = self._quiet("get", missing_key) if self._has(missing_key) else None
        return RoundFailure(
            "aborted",
            f"rank {abort.by} gave up waiting in {_round_text(abort.seq)}",
            missing=json.loads(missing.decode()) if missing else None,
            by=abort.by,
            late=True,
        )

    # -- the store, on set-up and failure only
    def _claim(self, seq: int, index: int) -> str:
        return f"{self.key}/{_claim_name(seq)}/{index}"

    def _quiet(self, op: str, *args: Any) -> Any:
        """A store request; None where the store is gone too (the job ends)."""
        self.store_requests += 1
        try:
            return getattr(self.store, op)(*args)
        except Exception:  # noqa: BLE001
            return None

    def _has(self, key: str) -> bool:
        return bool(self._quiet("check", [key]))

    def _read_abort(self) -> _Abort | None:
        key = f"{self.key}/abort"
        if not self._has(key):
            return None
        raw = self._quiet("get", key)
        return None if raw is None else _Abort.decode(raw)

    def _unclaimed(self, seq: int) -> bool:
        return any(
            not self._has(self._claim(seq, i))
            for i in range(len(self.ranks))
            if i != self.index
        )

    def _take_back(self, first: int, end: int) -> None:
        """Delete this member's keys of generations ``first`` to ``end - 1`` (and,
        on member 0, the keys they share)."""
        for gen in range(first, end):
            key = f"{self.base}/{gen}"
            mine = [f"{key}/here/{self.index}", f"{key}/in/{self.index}"]
            mine += [f"{key}/gloo/{d}/{self.index}" for d in range(_gloo_devices())]
            if self.index == 0:
                mine += [f"{key}/abort", f"{key}/missing", f"{key}/why"]
            for k in mine:
                self._quiet("delete_key", k)

    # -- teardown
    def close(self) -> None:
        """Drop the gloo group (its connections close: partners see it at once);
        the group is spent. No store request: at exit the store may be gone."""
        self.broken = True
        self._pg = None


def current_generation(store: Any, base: str) -> int:
    """The generation a stake's ranks meet on (0 until a round of it failed)."""
    try:
        if store.check([f"{base}/gen"]):
            return int(store.get(f"{base}/gen").decode())
    except Exception:  # noqa: BLE001 - no store: nothing failed that we can see
        pass
    return 0


class _Round(NamedTuple):
    """One operation of a round: its number, when its bound ends (monotonic)."""

    seq: int
    end: float

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

    Every ``send``/``recv`` is posted from the calling thread and each is waited
    on once, to the bound. The bound runs from :meth:`finish`, where this rank
    starts to wait, not from the post: what the rank computes in between is not
    a wait."""

    def __init__(
        self, group: StakeGroup, pg: Any, seq: int, values: Sequence[int], timeout: float
    ) -> None:
        self.group, self.pg, self.seq, self.timeout = group, pg, seq, timeout
        self.mine = torch.tensor(values, dtype=torch.int64)
        self.got = torch.empty_like(self.mine)
        self.steps = group.exchanges()
        self.t0 = time.monotonic()
        self.first = (
            self._post(self.steps[0], self.t0 + timeout) if self.steps else ()
        )

    def _post(self, step: _Exchange, deadline: float) -> tuple[Any, ...]:
        pg = self.pg
        try:
            sent = () if step.send is None else (pg.send([self.mine], step.peer, step.send),)
            got = () if step.recv is None else (pg.recv([self.got], step.peer, step.recv),)
        except RuntimeError as e:
            raise self.group._failed(self.seq, deadline) from e
        return got + sent

    def finish(self) -> list[int]:
        """Complete the round (the remaining exchanges, each posted and waited in
        turn); the element-wise maximum."""
        group = self.group
        start = time.monotonic()
        rnd = _Round(self.seq, start + self.timeout)
        try:
            for k, step in enumerate(self.steps):
                works = self.first if k == 0 else self._post(step, rnd.end)
                for work in works:
                    work.wait(rnd.left())
                if step.combine is not None:
                    step.combine(self.mine, self.got)
        except RuntimeError as e:
            raise group._failed(self.seq, rnd.end) from e
        except BaseException:
            group.close()
            raise
        group._completed()
        end = time.monotonic()
        group.last_round_s, group.last_wait_s = end - self.t0, end - start
        return self.mine.tolist()


_WORDS = 6
"""Every ``all_reduce`` of a round carries this many int64 (a tagged digest: the
tag, its negation, two words and theirs): ranks that ran different rounds still
issue operations of one shape, and the tags tell them apart."""


def _claim_name(seq: int) -> str:
    """The key under which the members claim round ``seq`` of a generation (each
    generation has at most one failed round: it ends the generation)."""
    return "here" if seq == _SETUP else "in"


def _gloo_devices() -> int:
    """How many gloo devices a group has (one per interface named in
    ``GLOO_SOCKET_IFNAME``): gloo's rendezvous keeps one key per device and rank."""
    names = os.environ.get("GLOO_SOCKET_IFNAME", "")
    return max(1, len([n for n in names.split(",") if n]))


def _round_text(seq: int) -> str:
    return "the group's set-up" if seq == _SETUP else f"round {seq}"


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
