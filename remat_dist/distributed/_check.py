"""``check_plan_consistency(group)``: compare the full remat plan of a group's ranks
on demand (a debugging aid: the agreements that make replay safe run by
themselves, in ``_step``). One round on the gloo group of the group's ranks, the
same group their agreements use."""

from __future__ import annotations

import json
from typing import Any

from remat_dist._errors import PlanMismatchError
from remat_dist._logging import get_logger
from remat_dist.distributed._plan import PlanDigest, explain
from remat_dist.distributed._ready import dist_ready
from remat_dist.distributed._rounds import CHECK
from remat_dist.distributed._stake_group import RoundFailure
from remat_dist.distributed._step import StepState, current_step

__all__ = ["check_plan_consistency"]

log = get_logger(__name__)


def check_plan_consistency(group: Any = None) -> None:
    """Compare, now, the full remat plan of the ranks of ``group`` (default: the
    world): every checkpoint run since this rank's previous completed call, its
    regions' decisions and collective modes, and the collectives it recorded per
    process group — also where no replay group forms, which the automatic
    agreements leave alone. A collective call: every rank of ``group`` calls it
    at the same point; one that does not come within the replay timeout makes the
    others raise (and a call that did not complete leaves the plan to compare as
    it was, so the next call on every rank compares the same checkpoints).

    A debugging aid: the agreements that make replay safe run anyway, among a
    replay group's ranks, before backward's first collective. A no-op without a
    process group.

    Args:
        group: the process group whose ranks compare (default: the world).

    Returns:
        None, once every rank of ``group`` ran the same plan.

    Raises:
        PlanMismatchError: on every rank of ``group`` where the plans differ,
            naming the first difference and the ranks; also where a rank did not
            call it within the replay timeout.

    Example::

        loss = model(batch).loss
        remat_dist.distributed.check_plan_consistency(tp_group)
        loss.backward()
    """
    from remat_dist.core import current_frame

    if current_frame() is not None:
        raise PlanMismatchError(
            "remat_dist.distributed.check_plan_consistency() was called inside a checkpoint; "
            "call it between steps (or after the forward), on every rank of the group."
        )
    if not dist_ready():
        return
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    _check(current_step(), tuple(dist.get_process_group_ranks(group)))


def _check(step: StepState, ranks: tuple[int, ...]) -> None:
    plan = step.full
    what = f"check_plan_consistency() of ranks {list(ranks)}"
    if len(ranks) < 2:
        step.full = PlanDigest()
        return
    try:
        got_all = step.run_round(ranks, CHECK, plan.words(), plan.payload)
    except RoundFailure as f:
        step.plan_check_failed()
        raise step.round_error(ranks, f, what, PlanMismatchError) from None
    step.full = PlanDigest()  # the round completed on every rank: compared
    if got_all is None:
        return
    step.plan_check_failed()
    text = explain({r: json.loads(v) for r, v in got_all.items()}, what)
    log.error("%s", text)
    raise PlanMismatchError(text)
