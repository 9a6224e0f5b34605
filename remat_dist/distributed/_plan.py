"""Plan consistency: every rank runs the same checkpoints and regions, with the same
save/recompute decisions.

A rank-dependent decision (a save region on one rank, recompute on another) or a
different sequence of checkpoints makes ranks replay different collectives, which
hangs a job. :func:`check_plan_consistency` compares the plans the ranks ran since
the last check; ``checkpoint(..., verify_plan=True)`` compares each checkpoint's plan
as its forward ends. The first check of a checkpoint exchanges the full plan, later
ones a fingerprint (the full plans are exchanged again only to explain a mismatch).
The comparison goes through the c10d store, never a collective, with a bounded
wait: a mismatch or a missing rank raises :class:`~remat_dist.errors.PlanMismatchError`
on every rank, naming the first differing region and the ranks that differ.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from remat_dist.core._record import CheckpointRecord, register_observer
from remat_dist.core._state import frame_var
from remat_dist.distributed._ledger_agreement import ReplayAgreement
from remat_dist.errors import CollectiveReplayError, PlanMismatchError

__all__ = ["check_plan_consistency", "plan_of"]

PLAN_TIMEOUT_S = 20.0

Plan = list[list[Any]]
"""``[[checkpoint name, [[region, "save"|"recompute"], ...]], ...]``."""


def plan_of(record: CheckpointRecord) -> list[Any]:
    """One checkpoint's plan entry: its name and its regions' decisions."""
    return [
        record.name,
        [
            [r.local_name, "recompute" if r.recompute else "save"]
            for r in record.regions
            if not r.inside_save
        ],
    ]


class _PlanLog:
    """Collects the plan of every checkpoint forward of this process, bounded: a
    running hash of all entries since the last check, and the first
    :data:`HEAD_ENTRIES` of them to explain a mismatch."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self._reset()

    def _reset(self) -> None:
        self.hasher = hashlib.sha256()
        self.count = 0
        self.head: Plan = []

    def take(self) -> tuple[Plan, str]:
        head, digest = self.head, f"{self.hasher.hexdigest()[:16]}:{self.count}"
        self._reset()
        return head, digest

    def on_checkpoint_end(
        self, record: CheckpointRecord, replay: bool, error: BaseException | None
    ) -> None:
        if replay or error is not None or not _dist_ready():
            return
        entry = plan_of(record)
        if record.options.get("verify_plan"):
            first = record.name not in self.seen
            self.seen.add(record.name)
            text = json.dumps([entry], separators=(",", ":"))
            digest = hashlib.sha256(text.encode()).hexdigest()[:16]
            _compare([entry], digest, group=None, label=record.name, full=first)
            return
        self.hasher.update(json.dumps(entry, separators=(",", ":")).encode())
        self.count += 1
        if len(self.head) < HEAD_ENTRIES:
            self.head.append(entry)


HEAD_ENTRIES = 1024
_log = _PlanLog()
_handle = register_observer(_log)
_agreements: dict[Any, ReplayAgreement] = {}


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _agreement(group: Any) -> ReplayAgreement:
    import torch.distributed as dist

    group = group or dist.group.WORLD
    key = str(group.group_name)
    agreement = _agreements.get(key)
    if agreement is None or agreement.group is not group:
        agreement = _agreements[key] = ReplayAgreement(
            group, timeout=PLAN_TIMEOUT_S, prefix="remat_dist/plan"
        )
    return agreement


def check_plan_consistency(group: Any = None) -> None:
    """Raise :class:`PlanMismatchError` on every rank of ``group`` (default: the
    world) unless all ran the same checkpoints and regions with the same decisions
    since the last check. Call it at the same point on every rank, e.g. after the
    first step's forward (the first check sends the full plan, later ones a
    fingerprint). A no-op without a process group.
    """
    if frame_var.get() is not None:
        raise PlanMismatchError(
            "remat_dist.check_plan_consistency() was called inside a checkpoint; "
            "call it between steps (or after the forward), on every rank."
        )
    if not _dist_ready():
        return
    head, digest = _log.take()
    first = "<step>" not in _log.seen
    _log.seen.add("<step>")
    _compare(head, digest, group=group, label="<step>", full=first)


def _compare(plan: Plan, digest: str, *, group: Any, label: str, full: bool) -> None:
    import torch.distributed as dist

    agreement = _agreement(group)
    try:
        if full:
            values, _ = agreement._round("plan-full", label, _payload(plan, digest))
        else:
            values, _ = agreement._round("plan", label, digest)
            if values is not None:  # fingerprints differ: exchange plans to say where
                values, _ = agreement._round("plan-full", label, _payload(plan, digest))
    except CollectiveReplayError as e:  # a rank did not arrive in time
        raise PlanMismatchError(
            f"rank {dist.get_rank()}: plan check at {label!r}: {e}".replace(
                "replay's", "plan check's"
            )
        ) from e
    if values is None:
        return
    plans = {r: json.loads(v)["head"] for r, v in values.items()}
    raise PlanMismatchError(_explain(plans, dist.get_rank(), label))


def _payload(plan: Plan, digest: str) -> str:
    return json.dumps({"digest": digest, "head": plan}, separators=(",", ":"))


def _flatten(plan: Plan) -> list[tuple[str, str]]:
    out = []
    for name, regions in plan:
        out.append((name, "checkpoint"))
        out.extend((f"{name}::{region}", decision) for region, decision in regions)
    return out


def _explain(plans: dict[int, Plan], rank: int, label: str) -> str:
    flat = {r: _flatten(p) for r, p in plans.items()}
    groups: dict[str, list[int]] = {}
    for r, f in sorted(flat.items()):
        groups.setdefault(json.dumps(f), []).append(r)
    ref_key = max(groups, key=lambda k: (len(groups[k]), -groups[k][0]))
    ref_ranks, ref = groups[ref_key], json.loads(ref_key)
    differ = sorted(r for k, rs in groups.items() if k != ref_key for r in rs)
    lines = []
    for r in differ:
        mine = flat[r]
        i = next(
            (i for i, (a, b) in enumerate(zip(mine, ref)) if tuple(a) != tuple(b)),
            min(len(mine), len(ref)),
        )
        theirs = f"{mine[i][0]}: {mine[i][1]}" if i < len(mine) else "(nothing more)"
        expected = f"{ref[i][0]}: {ref[i][1]}" if i < len(ref) else "(nothing more)"
        lines.append(f"  rank {r} at entry {i}: {theirs}   ranks {ref_ranks}: {expected}")
    return (
        f"rank {rank}: plan check at {label!r}: ranks {differ} ran another "
        f"checkpoint/region plan than ranks {ref_ranks}; first difference:\n"
        + "\n".join(lines)
        + "\nEvery rank must make the same save/recompute decisions and run the same "
        "checkpoints in the same order (a decision that depends on the rank or on "
        "the data makes replays issue different collectives). Fix: derive "
        "region(..., recompute=...) and the checkpointed blocks from configuration "
        "shared by all ranks."
    )
