"""The failure protocol of a stake's rounds, one transition per test
(``docs/distributed.md``, "When a round fails").

Each member is a thread of this process with its own gloo group over loopback
and an in-process ``HashStore`` for the job's store, so a test can place a
member's arrival before the bound, in the claim wait, after the mark, or at the
bound itself, and read the store afterwards.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from remat_dist.distributed import _stake_group
from remat_dist.distributed._stake_group import (
    RoundFailure,
    StakeGroup,
    current_generation,
)

BOUND_S = 0.5
WORDS = [1, 2, 3, 4, 5, 6]


def _threads(bodies) -> list:
    """Run each body on its own thread; what each returned or raised."""
    out: list = [None] * len(bodies)

    def run(i: int) -> None:
        try:
            out[i] = bodies[i]()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return out


def _set_up(store, base: str, n: int = 2) -> dict[int, StakeGroup]:
    """``n`` members whose group completed one round (set up on every member)."""
    ranks = tuple(range(n))
    groups = {r: StakeGroup(ranks, r, store, base, 0) for r in ranks}
    got = _threads([lambda r=r: groups[r].reduce_max([r] * 6, 10.0) for r in ranks])
    assert got == [[n - 1] * 6] * n, got
    return groups


def _after(seconds: float, group: StakeGroup, bound: float = BOUND_S):
    def body():
        time.sleep(seconds)
        return group.reduce_max(WORDS, bound)

    return body


def _failure(out) -> RoundFailure:
    assert isinstance(out, RoundFailure), out
    return out


def test_a_member_that_comes_before_the_bound_completes_it_with_no_store_request():
    store = dist.HashStore()
    groups = _set_up(store, "before")
    keys, requests = store.num_keys(), [g.store_requests for g in groups.values()]
    # a bound of 2 s and an arrival at 0.6 s: well inside it on a loaded machine
    out = _threads([_after(0.0, groups[0], 2.0), _after(0.6, groups[1], 2.0)])
    assert out == [WORDS, WORDS]
    assert store.num_keys() == keys  # a slow round leaves nothing behind
    assert [g.store_requests for g in groups.values()] == requests


def test_a_member_that_comes_during_the_claim_wait_took_part(monkeypatch):
    # rank 0 gives up at the bound and waits for claims; rank 1 comes then: its
    # exchange fails at once (rank 0's group closed), it claims the round and is
    # a participant: both raise, nobody is named missing, nobody is late
    monkeypatch.setattr(_stake_group, "GRACE_S", 1.5)
    store = dist.HashStore()
    groups = _set_up(store, "claim")
    out = _threads([_after(0.0, groups[0]), _after(BOUND_S + 0.4, groups[1])])
    giver, member = _failure(out[0]), _failure(out[1])
    assert (giver.reason, giver.missing, giver.late) == ("timeout", [], False)
    assert (member.reason, member.by, member.missing, member.late) == ("aborted", 0, [], False)
    assert current_generation(store, "claim") == 1


def test_a_member_that_comes_after_the_mark_is_late_and_told_so():
    store = dist.HashStore()
    groups = _set_up(store, "late")
    arrive = BOUND_S + _stake_group.GRACE_S + 1.0
    out = _threads([_after(0.0, groups[0]), _after(arrive, groups[1])])
    giver, member = _failure(out[0]), _failure(out[1])
    assert (giver.reason, giver.missing) == ("timeout", [1])
    assert (member.reason, member.by, member.missing, member.late) == ("aborted", 0, [1], True)
    # both meet on the next generation; its first round takes back the old keys
    nxt = {r: StakeGroup((0, 1), r, store, "late", 1, stale=0) for r in (0, 1)}
    assert _threads([lambda r=r: nxt[r].reduce_max([r] * 6, 10.0) for r in (0, 1)]) == [[1] * 6] * 2
    assert [k for k in ("abort", "missing", "in/0", "in/1") if store.check([f"late/0/{k}"])] == []


@pytest.mark.parametrize("offset", [-0.03, 0.0, 0.03])
def test_at_the_bound_every_member_reads_the_same_verdict(offset):
    # a member that comes just as the giver marks the absent ones is either a
    # participant (its claim stood) or late (the mark stood): never both, and
    # the giver names it missing exactly when it is told it came late
    store = dist.HashStore()
    base = f"edge{offset}"
    groups = _set_up(store, base)
    arrive = BOUND_S + _stake_group.GRACE_S + offset
    out = _threads([_after(0.0, groups[0]), _after(arrive, groups[1])])
    giver, member = _failure(out[0]), _failure(out[1])
    assert member.late == (1 in giver.missing), (giver.missing, member.late)
    assert member.missing == giver.missing


def test_a_set_up_its_peer_gave_up_on_tells_the_peer_it_came_late():
    store = dist.HashStore()
    groups = {r: StakeGroup((0, 1), r, store, "setup", 0) for r in (0, 1)}
    t0 = time.monotonic()
    alone = _failure(_threads([lambda: groups[0].reduce_max(WORDS, BOUND_S)])[0])
    assert time.monotonic() - t0 < BOUND_S + _stake_group.GRACE_S + 1.0
    assert (alone.reason, alone.missing) == ("timeout", [1]), str(alone)
    late = _failure(_threads([lambda: groups[1].reduce_max(WORDS, BOUND_S)])[0])
    assert (late.reason, late.by, late.late) == ("aborted", 0, True)


def test_three_members_one_absent_every_present_member_is_a_participant():
    # past 2 ranks a member may wait on another partner until its own bound: the
    # giver waits one more bound for claims, so no present member is marked
    store = dist.HashStore()
    groups = _set_up(store, "three", n=3)
    out = _threads([_after(0.0, groups[0]), _after(0.1, groups[1])])
    failures = [_failure(o) for o in out]
    assert all(f.missing == [2] and not f.late for f in failures), [
        (f.reason, f.missing, f.late) for f in failures
    ]
    late = _failure(_threads([lambda: groups[2].reduce_max(WORDS, BOUND_S)])[0])
    assert late.late and late.missing == [2]
