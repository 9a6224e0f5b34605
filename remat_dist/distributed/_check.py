"""``check_plan_consistency(group)``: compare the full remat plan of a group's ranks
on demand, through the c10d store (a debugging aid: the agreements that make
replay safe run by themselves, in ``_step``)."""

from __future__ import annotations

import json
from typing import Any

from remat_dist._errors import PlanMismatchError
from remat_dist._logging import get_logger
from remat_dist.distributed._channel import ChannelFailure
from remat_dist.distributed._plan import PlanDigest, explain, failure_text, plans_differ
from remat_dist.distributed._ready import dist_ready
from remat_dist.distributed._step import StepState, current_step, replay_timeout
from remat_dist.distributed._store_round import RoundTimeout, StoreRound

__all__ = ["check_plan_consistency"]

log = get_logger(__name__)

def check_plan_consistency(group: Any = None) -> None:
    """Compare, now, the full remat plan of the ranks of ``group`` (default: the
    world): every checkpoint run since this rank's previous call, its regions'
    decisions and collective modes, and the collectives it recorded per process
    group — also where no collective is at stake, which the automatic agreements
    leave alone. A collective call: every rank of ``group`` calls it at the same
    point; one that does not come within the replay timeout makes the others raise.

    Raises :class:`PlanMismatchError` on every rank of ``group`` unless all ran the
    same plan, naming the first difference and the ranks. A debugging aid: the
    agreements that make replay safe run anyway, among the ranks at stake, before
    backward's first collective. A no-op without a process group.
    """
    from remat_dist.core import current_frame

    if current_frame() is not None:
        raise PlanMismatchError(
            "remat_dist.check_plan_consistency() was called inside a checkpoint; "
            "call it between steps (or after the forward), on every rank of the group."
        )
    if not dist_ready():
        return
    import torch.distributed as dist

    _check(current_step(), group if group is not None else dist.group.WORLD)


def _check(step: StepState, group: Any) -> None:
    """``check_plan_consistency(group)``: one store round among ``group``'s ranks
    over the full plan since the last check."""
    import torch.distributed as dist

    plan, step.full = step.full, PlanDigest()
    name = str(group.group_name)
    rnd = step.checks.get(name)
    if rnd is None:
        ranks = tuple(dist.get_process_group_ranks(group))
        store = dist.PrefixStore(f"remat_dist/check/{step.namespace}/{name}", step.store)
        rnd = step.checks[name] = StoreRound(store, ranks, step.rank)
    what = f"check_plan_consistency() of ranks {list(rnd.ranks)}"
    try:
        verdict = rnd.exchange(plan.value(), timeout=replay_timeout(), judge=plans_differ)
        if verdict is not None:
            explained = rnd.exchange(plan.payload().decode(), timeout=replay_timeout())
    except RoundTimeout as t:
        failure = ChannelFailure(
            "timeout" if t.by is None else "aborted", "", missing=t.missing, by=t.by
        )
        text = failure_text(step.rank, rnd.ranks, failure, what, replay_timeout())
        log.error("%s", text)
        raise PlanMismatchError(text) from None
    if verdict is None:
        return
    text = explain({r: json.loads(v) for r, v in explained.items()}, what)
    log.error("%s", text)
    raise PlanMismatchError(text)
