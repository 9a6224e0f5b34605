"""Rounds among the ranks of one group over direct TCP links between them: the side
channel that carries a group's plan agreement and end-of-backward report.

Why not the c10d store: every rank of the job would send its requests to the one
store server, whose load grows with the world. Why not a gloo group: one exchange
between two ranks costs about five times a plain socket's here, and a gloo
operation that times out leaves the group unusable with no way to tell the late
rank why.

Topology: recursive doubling. Among ``n`` ranks, a round takes ``log2(n)`` hops
(two more when ``n`` is not a power of two: the ranks past the largest power of
two fold their value into a partner first and get the result back last); in each
hop a rank sends one message to one partner and receives one from it. A rank
holds a link only to its partners (at most ``log2(n) + 1``), made once through the
c10d store (the only store traffic of a healthy channel) and kept.

Failure: every wait is bounded by the round's deadline. A rank that waits longer
than ``SLOW_S`` (an eighth of the bound, for bounds over 2 s) posts its arrival
to the store, and watches for an abort there;
at the deadline it writes the abort (the round, itself, the ranks that never
posted an arrival) and closes its links. A closed link reaches the partners at
once, who read the abort and close theirs, so a round that fails on one rank fails
on every rank within a hop's time, and a rank that comes late reads why. A failed
channel is never used again: its owner makes the next generation.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from remat_dist._logging import get_logger
from remat_dist.distributed._wire import (
    advertised_host,
    nodelay,
    pack_parts,
    read_exact,
    unpack_parts,
)

__all__ = ["ChannelFailure", "SideChannel", "all_equal", "check_tag", "tagged_words"]

log = get_logger(__name__)

SLOW_S = 0.25
"""The shortest wait after which a rank posts its arrival to the store and looks
there for an abort (diagnostics); a round's bound over 2 s waits an eighth of it
(a healthy group arrives within milliseconds; a loaded machine should not turn
every round into store traffic)."""

_MAGIC = b"RDc1"
_HEADER = struct.Struct("!4sIBI")  # magic, round, kind, payload length
_REDUCE, _GATHER = 1, 2


class ChannelFailure(Exception):
    """A round did not complete on this rank.

    ``reason``: ``"timeout"`` (this rank gave up), ``"aborted"`` (another rank gave
    up: ``by``), ``"closed"`` (a partner's link closed with no abort posted: it
    died or exited), ``"out of step"`` (a partner ran another round). ``missing``:
    the ranks that never arrived, where known. ``stale``: the abort was of an
    earlier round that this rank completed (the caller may retry on a new
    generation).
    """

    comm_failure = True

    def __init__(
        self,
        reason: str,
        detail: str,
        *,
        missing: list[int] | None = None,
        by: int | None = None,
        stale: bool = False,
    ) -> None:
        super().__init__(detail)
        self.reason = reason
        self.missing = missing
        self.by = by
        self.stale = stale


def _partners(index: int, n: int) -> tuple[list[int], int | None, int | None]:
    """Recursive doubling: (hop partners, the extra rank folded into this one, the
    core rank this extra one folds into), as indices."""
    p = 1 << (n.bit_length() - 1)
    if index >= p:
        return [], None, index - p
    hops = [index ^ k for k in _powers(p)]
    return hops, (index + p if index + p < n else None), None


def _powers(p: int) -> list[int]:
    out, k = [], 1
    while k < p:
        out.append(k)
        k <<= 1
    return out


class SideChannel:
    """Rounds among ``ranks`` (sorted global ranks; ``rank`` is this process's).

    ``key`` names the channel in ``store`` and must be the same on every member and
    new for each generation. Every member must run the same rounds in the same
    order. Counters: ``rounds``, ``messages`` (sent by this rank), ``store_requests``
    (setup and slow paths only), ``last_round_s``.
    """

    def __init__(
        self,
        ranks: Sequence[int],
        rank: int,
        store: Any,
        key: str,
        timeout: float,
    ) -> None:
        self.ranks = tuple(ranks)
        self.rank = rank
        self.index = self.ranks.index(rank)
        self.store = store
        self.key = key
        self.seq = 0
        self.rounds = 0
        self.messages = 0
        self.store_requests = 0
        self.last_round_s = 0.0
        self.broken = False
        self._links: dict[int, socket.socket] = {}
        n = len(self.ranks)
        hops, extra, core = _partners(self.index, n)
        self._hops, self._extra, self._core = hops, extra, core
        if n > 1:
            self._connect(timeout)

    # -- setup
    def _peers(self) -> list[int]:
        out = list(self._hops)
        if self._extra is not None:
            out.append(self._extra)
        if self._core is not None:
            out.append(self._core)
        return out

    def _connect(self, timeout: float) -> None:
        """Make the links. Failures count as the channel's round 0: a rank that
        does not come within ``timeout`` makes the others post the abort."""
        deadline = time.monotonic() + timeout
        host = advertised_host(self.store)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1" if host.startswith("127.") else "", 0))
            listener.listen(64)
            port = listener.getsockname()[1]
            self._store("set", f"{self.key}/a/{self.index}", f"{host}:{port}")
            peers = self._peers()
            # the higher index dials, the lower accepts
            for j in sorted(p for p in peers if p < self.index):
                self._links[j] = self._dial(j, deadline, timeout)
            expected = {p for p in peers if p > self.index}
            while expected:
                now = time.monotonic()
                if now >= deadline:
                    raise self._setup_failure(timeout)
                listener.settimeout(max(0.001, min(deadline - now, SLOW_S)))
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    self._raise_if_aborted(0)
                    continue
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    hello = read_exact(conn, 8 + 4)
                except OSError:
                    conn.close()
                    continue
                token, j = hello[:8], struct.unpack("!I", hello[8:])[0]
                if token != self._token() or j not in expected:
                    conn.close()
                    continue
                nodelay(conn)
                self._links[j] = conn
                expected.discard(j)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()

    def _token(self) -> bytes:
        return hashlib.sha1(self.key.encode()).digest()[:8]

    def _dial(self, j: int, deadline: float, timeout: float) -> socket.socket:
        key = f"{self.key}/a/{j}"
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise self._setup_failure(timeout)
            try:
                self.store_requests += 1
                self.store.wait(
                    [key], timedelta(seconds=max(0.01, min(deadline - now, SLOW_S)))
                )
                break
            except Exception:
                self._raise_if_aborted(0)
        host, _, port = self._store("get", key).decode().rpartition(":")
        try:
            conn = socket.create_connection(
                (host, int(port)), timeout=max(0.01, deadline - time.monotonic())
            )
            nodelay(conn)
            conn.sendall(self._token() + struct.pack("!I", self.index))
        except OSError:
            raise self._closed(j, 0) from None
        return conn

    def _setup_failure(self, timeout: float) -> ChannelFailure:
        """Set-up did not complete in time: post the abort (the ranks that never
        posted their address are missing), or read the one posted first."""
        return self._post_abort(0, self._absent("a"), timeout, "was not set up")

    # -- rounds
    def reduce_max(self, values: Sequence[int], timeout: float) -> list[int]:
        """Element-wise maximum of every member's ``values`` (64-bit signed ints,
        the same length everywhere)."""
        fmt = struct.Struct(f"!{len(values)}q")

        def combine(a: bytes, b: bytes) -> bytes:
            return fmt.pack(*map(max, fmt.unpack(a), fmt.unpack(b)))

        out = self._round(_REDUCE, fmt.pack(*values), combine, timeout)
        return list(fmt.unpack(out))

    def gather(self, payload: bytes, timeout: float) -> dict[int, bytes]:
        """Every member's ``payload``, by global rank."""
        mine = pack_parts({self.rank: payload})

        def combine(a: bytes, b: bytes) -> bytes:
            return pack_parts({**unpack_parts(a), **unpack_parts(b)})

        return unpack_parts(self._round(_GATHER, mine, combine, timeout))

    def _round(
        self,
        kind: int,
        value: bytes,
        combine: Callable[[bytes, bytes], bytes],
        timeout: float,
    ) -> bytes:
        if self.broken:
            raise ChannelFailure("closed", "this side channel failed earlier")
        seq = self.seq
        self.seq += 1
        self.rounds += 1
        if len(self.ranks) == 1:
            return value
        t0 = time.monotonic()
        wait = _Wait(self, seq, t0 + timeout, timeout)
        try:
            if self._core is not None:  # an extra rank: fold in, get the result
                self._send(self._core, seq, kind, value)
                value = self._recv(self._core, seq, kind, wait)
            else:
                if self._extra is not None:
                    value = combine(value, self._recv(self._extra, seq, kind, wait))
                for j in self._hops:
                    self._send(j, seq, kind, value)
                    value = combine(value, self._recv(j, seq, kind, wait))
                if self._extra is not None:
                    self._send(self._extra, seq, kind, value)
        except ChannelFailure:
            self.close()
            raise
        except BaseException:
            self.close()
            raise
        self.last_round_s = time.monotonic() - t0
        return value

    def _send(self, j: int, seq: int, kind: int, payload: bytes) -> None:
        frame = _HEADER.pack(_MAGIC, seq & 0xFFFFFFFF, kind, len(payload)) + payload
        try:
            self._links[j].sendall(frame)
        except OSError:
            raise self._closed(j, seq) from None
        self.messages += 1

    def _recv(self, j: int, seq: int, kind: int, wait: _Wait) -> bytes:
        conn = self._links[j]
        header = wait.read(conn, _HEADER.size, j)
        magic, got_seq, got_kind, length = _HEADER.unpack(header)
        if magic != _MAGIC or got_seq != seq & 0xFFFFFFFF or got_kind != kind:
            raise ChannelFailure(
                "out of step",
                f"rank {self.ranks[j]} sent round {got_seq} ({_KIND.get(got_kind, '?')}) "
                f"where this rank runs round {seq} ({_KIND[kind]}): the ranks ran "
                "other rounds (another number of steps, or a step that raised on "
                "some ranks only)",
            )
        return wait.read(conn, length, j) if length else b""

    def _closed(self, j: int, seq: int) -> ChannelFailure:
        """Partner ``j``'s link closed: it aborted (read why) or it went away."""
        abort = self._read_abort(grace=min(1.0, SLOW_S * 4))
        if abort is not None:
            return _aborted(abort, seq)
        return ChannelFailure(
            "closed",
            f"rank {self.ranks[j]} closed its side-channel link in round {seq}: it "
            "exited, died, or raised out of the step",
            missing=[self.ranks[j]],
        )

    # -- the store, on slow paths only
    def _store(self, op: str, *args: Any) -> Any:
        self.store_requests += 1
        return getattr(self.store, op)(*args)

    def _read_abort(
        self, grace: float = 0.0
    ) -> tuple[int, int, list[int] | None] | None:
        key = f"{self.key}/abort"
        end = time.monotonic() + grace
        while True:
            try:
                if self._store("check", [key]):
                    seq, by, missing = self._store("get", key).decode().split(":", 2)
                    return int(seq), int(by), json.loads(missing)
            except Exception:
                return None  # the store is gone too (the job is ending)
            if time.monotonic() >= end:
                return None
            time.sleep(0.02)

    def _raise_if_aborted(self, seq: int) -> None:
        abort = self._read_abort()
        if abort is not None:
            raise _aborted(abort, seq)

    def post_arrival(self, seq: int) -> None:
        try:
            self._store("set", f"{self.key}/arr/{seq}/{self.index}", "1")
        except Exception:
            pass

    def _absent(self, kind: str, seq: int | None = None) -> list[int] | None:
        """Members without a ``kind`` key (an address, or an arrival in ``seq``)."""
        out = []
        try:
            for i, r in enumerate(self.ranks):
                key = (
                    f"{self.key}/{kind}/{i}"
                    if seq is None
                    else f"{self.key}/{kind}/{seq}/{i}"
                )
                if i != self.index and not self._store("check", [key]):
                    out.append(r)
        except Exception:
            return None
        return out

    def give_up(self, seq: int, timeout: float) -> ChannelFailure:
        """The round's deadline passed: post the abort (or read the one posted
        first)."""
        return self._post_abort(
            seq, self._absent("arr", seq), timeout, f"round {seq} did not complete"
        )

    def _post_abort(
        self, seq: int, missing: list[int] | None, timeout: float, what: str
    ) -> ChannelFailure:
        mine = f"{seq}:{self.rank}:{json.dumps(missing)}"
        try:
            won = self._store("compare_set", f"{self.key}/abort", "", mine).decode()
        except Exception:
            won = mine
        a_seq, by, gone = won.split(":", 2)
        if int(by) != self.rank:
            return _aborted((int(a_seq), int(by), json.loads(gone)), seq)
        if what == "was not set up":
            what = f"the side channel of ranks {list(self.ranks)} was not set up"
        return ChannelFailure(
            "timeout", f"{what} within {timeout:g} s", missing=missing
        )

    # -- teardown
    def _close_links(self) -> None:
        for conn in self._links.values():
            try:
                conn.close()
            except OSError:
                pass
        self._links.clear()

    def close(self) -> None:
        """Close every link (partners see it at once); the channel is spent."""
        self.broken = True
        self._close_links()


class _Wait:
    """Reads bounded by a round's deadline, with the slow path: post the arrival
    after ``every`` seconds (``SLOW_S``, or an eighth of a long bound), then look
    for an abort as often until the deadline."""

    def __init__(self, channel: SideChannel, seq: int, deadline: float, timeout: float):
        self.channel = channel
        self.seq = seq
        self.deadline = deadline
        self.timeout = timeout
        self.every = min(timeout / 4, max(SLOW_S, timeout / 8))
        self.slow_at = time.monotonic() + self.every
        self.posted = False

    def read(self, conn: socket.socket, n: int, j: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            now = time.monotonic()
            if now >= self.deadline:
                raise self.channel.give_up(self.seq, self.timeout)
            if now >= self.slow_at:
                self._slow()
            conn.settimeout(max(0.001, min(self.deadline, self.slow_at) - now))
            try:
                chunk = conn.recv(n - len(buf))
            except TimeoutError:
                continue
            except OSError:
                raise self.channel._closed(j, self.seq) from None
            if not chunk:
                raise self.channel._closed(j, self.seq)
            buf += chunk
        return bytes(buf)

    def _slow(self) -> None:
        ch = self.channel
        if not self.posted:
            ch.post_arrival(self.seq)
            self.posted = True
        ch._raise_if_aborted(self.seq)
        self.slow_at = time.monotonic() + self.every


_KIND = {_REDUCE: "reduce", _GATHER: "gather"}


def _aborted(abort: tuple[int, int, list[int] | None], seq: int) -> ChannelFailure:
    a_seq, by, missing = abort
    return ChannelFailure(
        "aborted",
        f"rank {by} gave up waiting in round {a_seq}",
        missing=missing,
        by=by,
        stale=a_seq < seq,
    )


# ---------------------------------------------------- equality by one max-reduce


def tagged_words(tag: int, words: list[int]) -> list[int]:
    """``words`` and their negations behind a round tag: after a max-reduce, the
    ranks sent equal words exactly when each word equals minus its negation's max
    (:func:`all_equal`), and the tag says which kind of round every rank ran."""
    return [tag, -tag, *words, *(-w for w in words)]


def check_tag(got: list[int], tag: int, stake: tuple[int, ...]) -> None:
    if got[0] != tag or -got[1] != tag:
        raise ChannelFailure(
            "out of step",
            f"the ranks of {list(stake)} ran different rounds (agreement vs report): "
            "they ran another number of steps, or a step raised on some ranks only",
        )


def all_equal(got: list[int], words: list[int]) -> bool:
    n = len(words)
    return all(got[i] == -got[n + i] for i in range(n))
