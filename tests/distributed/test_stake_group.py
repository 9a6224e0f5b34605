"""A stake's rounds on torch's gloo: one all_reduce per healthy round and no store
request, bounded waits whose failure reaches every member with the ranks that
never came, a late rank told so, generations that let the ranks meet again, and a
group that cannot connect reported as such (not as a plan mismatch).

Real processes through the harness for 2 ranks; threads of one process (each its
own gloo group over loopback, an in-process HashStore for the store) for 3 ranks
and the late rank.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import remat_dist as remat
from remat_dist._torch import _c10d
from remat_dist.distributed._stake_group import (
    RoundFailure,
    StakeGroup,
    current_generation,
)
from remat_dist.testing import DistContext, distributed


@distributed(world_size=2)
def test_rounds_on_two_ranks_cost_one_operation_and_no_store_request(ctx: DistContext):
    store = _c10d.default_store()
    group = StakeGroup((0, 1), ctx.rank, store, f"test/{ctx.shared_dir}", 0)
    try:
        assert group.reduce_max([ctx.rank, -ctx.rank, 7], 5.0) == [1, 0, 7]
        setup = group.store_requests
        assert setup >= 1  # the set-up posted where this rank's gloo listens
        for _ in range(5):
            group.reduce_max([1, 2, 3, 4, 5, 6], 5.0)
        assert group.store_requests == setup  # healthy rounds: no store request
        assert group.rounds == 6
        parts = group.gather(f"r{ctx.rank}".encode() * (ctx.rank + 3), 5.0)
        assert parts == {r: f"r{r}".encode() * (r + 3) for r in (0, 1)}
    finally:
        group.close()


def _threads(n: int, body, store) -> list:
    """``body(rank)`` on ``n`` threads of this process; what each returned or
    raised."""
    out: list = [None] * n

    def run(rank: int) -> None:
        try:
            out[rank] = body(rank)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return out


def test_a_rank_that_never_comes_is_named_on_every_member_and_the_late_rank_is_told():
    store = dist.HashStore()
    ranks = (0, 1, 2)
    groups = {r: StakeGroup(ranks, r, store, "t3", 0) for r in ranks}
    # a healthy round first: the group is set up on every member
    assert _threads(3, lambda r: groups[r].reduce_max([r] * 6, 10.0), store) == [[2] * 6] * 3

    def members(r: int):
        if r == 2:
            return None  # busy elsewhere: never comes to round 1
        t0 = time.monotonic()
        try:
            groups[r].reduce_max([1] * 6, 1.0)
        except RoundFailure as f:
            return f, time.monotonic() - t0
        return "completed"

    out = _threads(3, members, store)
    for r in (0, 1):
        f, elapsed = out[r]
        assert elapsed < 4.0, elapsed
        assert f.missing == [2], (f.reason, f.missing, str(f))
        assert f.reason in ("timeout", "aborted") and not f.late
    assert {out[0][0].reason, out[1][0].reason} == {"timeout", "aborted"} or (
        out[0][0].reason == out[1][0].reason == "timeout"
    )
    # the stake moved on; the arrivals of the failed round were taken back
    assert current_generation(store, "t3") == 1
    assert not store.check(["t3/0/arr/1/0"]) and not store.check(["t3/0/arr/1/1"])
    # rank 2 comes late: its round fails at once, and it is told it came late
    t0 = time.monotonic()
    with pytest.raises(RoundFailure) as info:
        groups[2].reduce_max([1] * 6, 5.0)
    assert time.monotonic() - t0 < 2.0
    assert info.value.late and info.value.missing == [2]
    # every member meets on the next generation
    nxt = {r: StakeGroup(ranks, r, store, "t3", current_generation(store, "t3")) for r in ranks}
    assert _threads(3, lambda r: nxt[r].reduce_max([r, 0, 0, 0, 0, 0], 10.0), store) == [
        [2, 0, 0, 0, 0, 0]
    ] * 3
    for g in (*groups.values(), *nxt.values()):
        g.close()


def _setup_fails_body(path: str, rank0_late_s: float = 0.0) -> None:
    """Rank 1's gloo cannot be made (its interface variable names no interface):
    at the first agreement both ranks raise AgreementSetupError, not a plan
    mismatch; the fix names the interface variable."""
    from remat_dist.testing import dist_context

    ctx = dist_context()
    remat.distributed.set_replay_timeout(2.0)
    if ctx.rank == 1:
        os.environ["GLOO_SOCKET_IFNAME"] = "rdnoif0"
    try:
        x = torch.randn(4, 8, requires_grad=True)
        if ctx.rank == 0:
            time.sleep(rank0_late_s)  # past the grace: rank 1 marks it absent

        def body(t):
            buf = torch.ones(2)
            dist.all_reduce(buf)
            return t.sin() * buf[0]

        y = remat.checkpoint(region_name="setup_blk")(body)(x)
        t0 = time.perf_counter()
        try:
            y.sum().backward()
            outcome = "no error"
        except Exception as exc:  # noqa: BLE001 - recorded for the parent
            outcome = f"{type(exc).__name__}: {exc}"
        with open(f"{path}.{ctx.rank}", "w") as f:
            f.write(f"{time.perf_counter() - t0:.3f}\n{outcome}")
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
        remat.distributed.set_replay_timeout(20.0)


@pytest.mark.parametrize("rank0_late_s", [0.0, 1.5])
def test_a_group_that_cannot_be_set_up_says_so_on_every_rank(tmp_path, rank0_late_s):
    # rank 0 comes with rank 1, or after rank 1 gave up and marked it absent (it
    # then meets the next generation: the set-up failure is said there too)
    from remat_dist.testing import run_distributed

    path = str(tmp_path / "outcome")
    run_distributed(_setup_fails_body, path, rank0_late_s, world_size=2, timeout=60)
    for rank in (0, 1):
        elapsed, outcome = open(f"{path}.{rank}").read().split("\n", 1)
        assert outcome.startswith("AgreementSetupError: "), outcome
        assert "could not start" in outcome and "GLOO_SOCKET_IFNAME" in outcome, outcome
        assert float(elapsed) < 8.0, outcome
    assert "rdnoif0" in open(f"{path}.1").read()
