"""The side channel that carries the agreements: direct links among a group's ranks,
recursive doubling, bounded rounds whose failure reaches every member.

Real processes through the harness (its FileStore stands in for the job's store)
for 2 and 4 ranks, threads of one process over loopback for the sizes that fold
(3, 5, 6) and the late rank; a rank that leaves and two ranks that run different
rounds, each seen by every member within the bound and with the right words.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from remat_dist.distributed._channel import ChannelFailure, SideChannel
from remat_dist.testing import DistContext, distributed


def _channel(ctx: DistContext, name: str, timeout: float = 5.0) -> SideChannel:
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    ranks = tuple(range(ctx.world_size))
    return SideChannel(ranks, ctx.rank, store, f"test/{ctx.test_name}/{name}", timeout)


def _rounds(ctx: DistContext) -> None:
    ch = _channel(ctx, "values")
    assert ch.store_requests >= 1  # the set-up posts this rank's address there
    try:
        got = ch.reduce_max([ctx.rank, -ctx.rank, 7], 5.0)
        assert got == [ctx.world_size - 1, 0, 7]
        parts = ch.gather(f"r{ctx.rank}".encode() * (ctx.rank + 1), 5.0)
        assert parts == {r: f"r{r}".encode() * (r + 1) for r in range(ctx.world_size)}
        # recursive doubling: log2(n) messages per round on a power of two; the
        # ranks past it send one and get one back, their partners one more each
        n = ctx.world_size
        p = 1 << (n.bit_length() - 1)
        hops = p.bit_length() - 1
        if ctx.rank >= p:
            expected = 1
        else:
            expected = hops + (1 if ctx.rank + p < n else 0)
        assert ch.messages == 2 * expected, (ch.messages, expected)
    finally:
        ch.close()


@distributed(world_size=2)
def test_rounds_on_two_ranks(ctx: DistContext):
    _rounds(ctx)


def _threads(n: int, body, timeout: float = 5.0) -> list:
    """``body(rank, channel)`` on ``n`` threads of this process, each a member of one
    side channel over loopback (the store: an in-process HashStore)."""
    import threading

    store = dist.HashStore()
    out: list = [None] * n

    def run(rank: int) -> None:
        try:
            ch = SideChannel(tuple(range(n)), rank, store, f"t{n}", timeout)
            try:
                out[rank] = body(rank, ch)
            finally:
                ch.close()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("n", [3, 5, 6, 8])
def test_rounds_on_sizes_that_fold(n):
    # past the largest power of two, ranks fold into a partner and get the result
    # back: every member still gets every value, in log2 hops plus two
    def body(rank, ch):
        got = ch.reduce_max([rank, -rank], 5.0)
        parts = ch.gather(bytes([rank]) * (rank + 1), 5.0)
        return got, parts, ch.messages

    results = _threads(n, body)
    p = 1 << (n.bit_length() - 1)
    for rank, r in enumerate(results):
        assert not isinstance(r, BaseException), r
        got, parts, messages = r
        assert got == [n - 1, 0]
        assert parts == {q: bytes([q]) * (q + 1) for q in range(n)}
        hops = p.bit_length() - 1
        per_round = 1 if rank >= p else hops + (1 if rank + p < n else 0)
        assert messages == 2 * per_round


@distributed(world_size=4)
def test_rounds_on_four_ranks(ctx: DistContext):
    _rounds(ctx)


def test_a_late_rank_makes_every_member_raise_within_the_bound():
    def body(rank, ch):
        ch.reduce_max([1], 5.0)
        t0 = time.monotonic()
        if rank == 2:
            time.sleep(2.0)  # past the others' bound of 1 s
        try:
            ch.reduce_max([1], 1.0)
        except ChannelFailure as f:
            return f, time.monotonic() - t0, ch.broken
        return None

    results = _threads(3, body)
    for rank, (f, elapsed, broken) in enumerate(results):
        assert broken
        if rank == 2:
            # comes late: reads the abort at once, instead of waiting its own bound
            assert f.reason == "aborted" and f.by in (0, 1), (f.reason, str(f))
            assert f.missing == [2]
            assert elapsed < 2.0 + 0.9
        else:
            assert f.reason in ("timeout", "aborted"), (f.reason, str(f))
            assert f.missing == [2], f.missing
            assert elapsed < 1.0 + 1.5


@distributed(world_size=2)
def test_a_member_that_leaves_is_seen_at_once(ctx: DistContext):
    ch = _channel(ctx, "leave")
    ch.reduce_max([1], 5.0)
    if ctx.rank == 1:
        ch.close()  # what its exit does to the links
    else:
        t0 = time.monotonic()
        with pytest.raises(ChannelFailure) as ei:
            ch.reduce_max([1], 10.0)
        assert ei.value.reason == "closed", ei.value.reason
        assert "rank 1 closed its side-channel link" in str(ei.value)
        assert time.monotonic() - t0 < 3.0  # the grace for an abort note, not the bound
    dist.barrier()


@distributed(world_size=2)
def test_members_running_different_rounds_are_out_of_step(ctx: DistContext):
    ch = _channel(ctx, "step")
    try:
        with pytest.raises(ChannelFailure) as ei:
            if ctx.rank == 0:
                ch.reduce_max([1], 5.0)
            else:
                ch.gather(b"x", 5.0)
        assert ei.value.reason in ("out of step", "closed", "aborted"), ei.value.reason
    finally:
        ch.close()
        dist.barrier()


@distributed(world_size=2)
def test_an_abort_of_a_round_this_rank_completed_is_stale(ctx: DistContext):
    # The race at a deadline: rank 1 gives up on round 0 just as rank 0 completes
    # it. Rank 0 learns it in its next round and may run that round again on a new
    # channel: the failure is marked stale.
    ch = _channel(ctx, "stale")
    ch.reduce_max([1], 5.0)
    if ctx.rank == 1:
        ch.give_up(0, 1.0)
        ch.close()
    else:
        with pytest.raises(ChannelFailure) as ei:
            ch.reduce_max([1], 5.0)
        assert ei.value.reason == "aborted" and ei.value.stale, (ei.value.reason, str(ei.value))
    dist.barrier()
