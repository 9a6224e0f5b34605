"""The side channel that carries the agreements: direct links among a group's ranks,
recursive doubling, bounded rounds whose failure reaches every member.

Real processes through the harness (its FileStore stands in for the job's store):
values and message counts for 2, 3 and 4 ranks; a late rank, a rank that leaves
and two ranks that run different rounds, each seen by every member within the
bound and with the right words.
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


@distributed(world_size=3)
def test_rounds_on_three_ranks(ctx: DistContext):
    _rounds(ctx)


@distributed(world_size=4)
def test_rounds_on_four_ranks(ctx: DistContext):
    _rounds(ctx)


@distributed(world_size=3)
def test_a_late_rank_makes_every_member_raise_within_the_bound(ctx: DistContext):
    ch = _channel(ctx, "late", timeout=5.0)
    try:
        ch.reduce_max([1], 5.0)
        t0 = time.monotonic()
        if ctx.rank == 2:
            time.sleep(2.0)  # past the others' bound of 1 s
        with pytest.raises(ChannelFailure) as ei:
            ch.reduce_max([1], 1.0)
        elapsed = time.monotonic() - t0
        f = ei.value
        if ctx.rank == 2:
            # comes late: reads the abort at once, instead of waiting its own bound
            assert f.reason == "aborted" and f.by in (0, 1), (f.reason, str(f))
            assert f.missing == [2]
            assert elapsed < 2.0 + 0.9
        else:
            assert f.reason in ("timeout", "aborted"), (f.reason, str(f))
            assert f.missing == [2], f.missing
            assert elapsed < 1.0 + 1.5
        assert ch.broken
    finally:
        ch.close()
        dist.barrier()


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
