"""One plan agreement per step, before backward's first collective, and one failure
report at backward's end: the two store rounds that make replay safe by
construction.

What a step is: the checkpoints run in forward since the last agreement (plus any
``mark_step()``), and the backward that replays them. Its life, per process::

    IDLE --forward checkpoint / mark_step--> ARMED
    ARMED --first collective in backward, first replay, check_plan_consistency()-->
        AGREED   (store exchange: every rank posts its plan digest)
    AGREED --inside backward--> IN_BACKWARD  (a callback is queued for its end)
    IN_BACKWARD --backward ends--> IDLE       (store report: failures, if any)

The agreement compares, across the ranks of the step group (the world), the
sequence of checkpoints run in forward with each one's collective mode and every
region's decision and mode, and, per process group, the rank-invariant fingerprint
of the collectives each checkpoint's forward issued on it (compared among that
group's ranks only). It runs before backward issues its first collective on any
rank (the collective kernels call :meth:`StepAgreement.in_backward` first), so a
mismatch raises :class:`PlanMismatchError` on every rank while no rank is inside a
collective. A replay that diverges or raises on one rank is absorbed there (the
core completes it with stand-ins, the rank releases the collectives its peers
wait for, see ``_verify``), so every rank runs the same backward; the report at
backward's end then raises the same :class:`CollectiveReplayError` on every rank,
before the optimizer step.
"""

from __future__ import annotations

import atexit
import enum
import hashlib
import json
import threading
from typing import Any

import torch

from remat_dist._logging import get_logger
from remat_dist.distributed._intercept import set_backward_watch
from remat_dist.distributed._ready import dist_ready
from remat_dist.distributed._store_round import RoundTimeout, StoreRound
from remat_dist.errors import CollectiveReplayError, PlanMismatchError

__all__ = ["StepAgreement", "current_step", "mark_step", "set_replay_timeout"]

log = get_logger(__name__)

REPLAY_TIMEOUT_S = 20.0
"""Default bound (seconds) for a store round and for each replayed collective."""

HEAD_ENTRIES = 64
"""Plan entries each rank sends to explain a mismatch."""

_timeout = REPLAY_TIMEOUT_S
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_graph_task_id = torch._C._current_graph_task_id


def set_replay_timeout(seconds: float) -> None:
    """Bound (seconds) for every rank to reach a step's agreement or report, and
    for each replayed collective; past it, each rank raises instead of waiting. Call
    it on every rank before training."""
    global _timeout
    _timeout = float(seconds)


def replay_timeout() -> float:
    return _timeout


class StepPhase(enum.Enum):
    IDLE = "idle"
    ARMED = "armed"
    AGREED = "agreed"
    IN_BACKWARD = "in backward"


class StepAgreement:
    """The step machine of one process for the ranks of ``group`` (the world)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank()
        ranks = tuple(dist.get_process_group_ranks(self.group))
        name = str(self.group.group_name)
        store = dist.PrefixStore(
            f"remat_dist/step/{_namespace}/{name}", c10d._get_default_store()
        )
        self.round = StoreRound(store, ranks, self.rank)
        self.phase = StepPhase.IDLE
        self.steps = 0
        self.failures: list[str] = []
        # backward may run on the engine's device threads: one transition at a time
        self._lock = threading.RLock()
        self._reset_plan()

    # -- plan
    def _reset_plan(self) -> None:
        self._hasher = hashlib.sha256()
        self._groups: dict[str, Any] = {}
        self._count = 0
        self._head: list[Any] = []

    def add_checkpoint(self, entry: list[Any], group_fps: dict[str, str]) -> None:
        """A checkpoint's forward ended: ``entry`` is its plan, ``group_fps`` its
        ledger's fingerprint per process group."""
        self._settle_stale()
        self.arm()
        self._hasher.update(json.dumps(entry, separators=(",", ":")).encode())
        for key, fp in group_fps.items():
            h = self._groups.get(key)
            if h is None:
                h = self._groups[key] = hashlib.sha256()
            h.update(f"{self._count}:{fp}\n".encode())
        self._count += 1
        if len(self._head) < HEAD_ENTRIES:
            self._head.append([*entry, group_fps])

    def arm(self) -> None:
        """Something in this step needs agreeing (again, after an early
        ``check_plan_consistency()``)."""
        self._settle_stale()
        if self.phase is StepPhase.IDLE or self.phase is StepPhase.AGREED:
            self.phase = StepPhase.ARMED
            set_backward_watch(self.in_backward)

    def _value(self) -> str:
        return json.dumps(
            {
                "p": f"{self._hasher.hexdigest()[:16]}:{self._count}",
                "g": {k: h.hexdigest()[:16] for k, h in sorted(self._groups.items())},
            },
            separators=(",", ":"),
        )

    # -- the agreement
    def in_backward(self) -> float | None:
        """Before every collective of a backward and before every replay starts:
        agree if this step has not; returns the bound (seconds) for the collective
        while a step's backward runs (None: no step)."""
        phase = self.phase
        if phase is StepPhase.IN_BACKWARD:
            return _timeout
        if phase is StepPhase.IDLE:
            return None
        with self._lock:
            if self.phase is StepPhase.ARMED:
                self.agree("backward")
            if self.phase is StepPhase.AGREED and _graph_task_id() != -1:
                _queue_callback(self._end_of_backward)
                self.phase = StepPhase.IN_BACKWARD
        return _timeout

    def replay_starts(self) -> None:
        """A replay starts: agree if not yet done in this backward (a backward that
        replays checkpoints of an earlier, already agreed step agrees on nothing)."""
        self._settle_stale()
        with self._lock:
            if self.phase is StepPhase.IDLE:
                self.phase = StepPhase.ARMED
            self.in_backward()

    def agree(self, where: str) -> None:
        """The step's one exchange; raises :class:`PlanMismatchError` everywhere."""
        value = self._value()
        head = self._head
        self._reset_plan()
        self.phase = StepPhase.AGREED
        try:
            verdict = self.round.exchange(value, timeout=_timeout, judge=_plans_differ)
            if verdict is not None:
                payload = json.dumps({"v": value, "head": head}, separators=(",", ":"))
                explained = self.round.exchange(payload, timeout=_timeout)
        except RoundTimeout as t:
            self.phase = StepPhase.IDLE
            text = _timeout_text(self, t, f"the plan agreement ({where})")
            log.error("%s", text)
            raise PlanMismatchError(text) from None
        except BaseException:
            self.phase = StepPhase.IDLE
            raise
        if verdict is None:
            log.info(
                "step %d: plan agreed at %s (%d checkpoints) in %.2f ms; %d store "
                "requests by this rank so far",
                self.steps, where, len(head), self.round.last_round_s * 1e3,
                self.round.requests,
            )
            return
        self.phase = StepPhase.IDLE
        plans = {r: json.loads(v) for r, v in (explained or {}).items()}
        text = _explain(plans)
        log.error("step %d: %s", self.steps, text)
        raise PlanMismatchError(text)

    # -- failures and the report
    def fail(self, message: str) -> None:
        """This rank's replay failed and was absorbed: the step must fail."""
        self.failures.append(message)

    def _end_of_backward(self) -> None:
        self.phase = StepPhase.IDLE
        self.steps += 1
        failure = self.failures[0] if self.failures else None
        self.failures = []
        self._report(failure)

    def _report(self, failure: str | None) -> None:
        try:
            verdict = self.round.report(failure, timeout=_timeout)
        except RoundTimeout as t:
            text = _timeout_text(self, t, "the end of backward")
            log.error("%s", text)
            raise CollectiveReplayError(text) from None
        log.debug(
            "end-of-backward report in %.2f ms: %s",
            self.round.last_round_s * 1e3, "ok" if verdict is None else sorted(verdict),
        )
        if verdict is None:
            return
        failed = sorted(verdict)
        reports = "\n".join(f"[rank {r}] {verdict[r]}" for r in failed)
        err = CollectiveReplayError(
            f"the replay diverged or failed on ranks {failed}; every rank of the step "
            f"stops at the end of backward (the gradients of this step are wrong: "
            f"do not step the optimizer).\n{reports}"
        )
        err.failed_ranks = failed  # type: ignore[attr-defined]
        log.error("%s", err)
        raise err

    def _settle_stale(self) -> None:
        """A backward that raised never reached its end: take part in its report
        (saying so) so that the ranks' rounds stay aligned."""
        if self.phase is not StepPhase.IN_BACKWARD or _graph_task_id() != -1:
            return
        self.phase = StepPhase.IDLE
        self.failures = []
        try:
            self._report(f"rank {self.rank}: backward raised before the end of the step")
        except (CollectiveReplayError, PlanMismatchError):
            pass


def _plans_differ(values: dict[int, str]) -> bool:
    plans = {json.loads(v)["p"] for v in values.values()}
    if len(plans) > 1:
        return True
    return bool(_group_mismatches({r: json.loads(v)["g"] for r, v in values.items()}))


def _group_mismatches(groups: dict[int, dict[str, str]]) -> list[str]:
    """Per process group: its ranks must hold equal fingerprints."""
    members: dict[str, dict[int, str]] = {}
    for r, g in groups.items():
        for key, fp in g.items():
            members.setdefault(key, {})[r] = fp
    out = []
    for key, fps in sorted(members.items()):
        size = int(key.rsplit("/", 1)[1])
        if len(fps) != size or len(set(fps.values())) > 1:
            out.append(key)
    return out


def _timeout_text(step: StepAgreement, t: RoundTimeout, what: str) -> str:
    who = (
        f"ranks {t.missing}" if t.missing else
        f"{len(step.round.ranks) - t.arrived} rank(s)"
    )
    by = "" if t.by is None else f" (rank {t.by} gave up waiting first)"
    return (
        f"rank {step.rank}: {who} of the step group did not reach {what} within "
        f"{_timeout:g} s{by}: they stalled, died, raised earlier in this step, or "
        "run another number of steps. No rank issued a collective of this backward "
        "after it. Fix the failing rank (its own error says why); raise the bound "
        "with remat_dist.set_replay_timeout(seconds)."
    )


def _flatten(plan: list[Any]) -> list[tuple[str, str]]:
    out = []
    for name, mode, regions, _ in plan:
        out.append((name, f"checkpoint, collectives={mode}"))
        out.extend(
            (f"{name}::{region}", f"{decision}, collectives={rmode}")
            for region, decision, rmode in regions
        )
    return out


def _explain(plans: dict[int, dict[str, Any]]) -> str:
    fix = (
        "Every rank must run the same checkpoints in the same order with the same "
        "save/recompute decisions and collective modes, and issue the same "
        "collectives inside them (a decision that depends on the rank or on the data "
        "makes replays issue different collectives). Fix: derive region(..., "
        "recompute=...), collectives= and the checkpointed blocks from configuration "
        "shared by all ranks."
    )
    flat = {r: _flatten(p["head"]) for r, p in plans.items()}
    groups: dict[str, list[int]] = {}
    for r, f in sorted(flat.items()):
        groups.setdefault(json.dumps(f), []).append(r)
    if len(groups) > 1:
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
            theirs = f"{mine[i][0]} ({mine[i][1]})" if i < len(mine) else "(nothing more)"
            expected = f"{ref[i][0]} ({ref[i][1]})" if i < len(ref) else "(nothing more)"
            lines.append(f"  rank {r} at entry {i}: {theirs}   ranks {ref_ranks}: {expected}")
        return (
            f"the plan agreement of this step failed: ranks {differ} ran another "
            f"checkpoint/region plan than ranks {ref_ranks}; first difference:\n"
            + "\n".join(lines) + "\n" + fix
        )
    heads = {r: p["head"] for r, p in plans.items()}
    keys = _group_mismatches({r: json.loads(p["v"])["g"] for r, p in plans.items()})
    lines = []
    for key in keys:
        by_ckpt: dict[int, dict[int, str]] = {}
        for r, head in heads.items():
            for i, entry in enumerate(head):
                fp = entry[3].get(key, "nothing")
                by_ckpt.setdefault(i, {})[r] = fp
        first = next(
            (i for i in sorted(by_ckpt) if len(set(by_ckpt[i].values())) > 1), None
        )
        if first is None:
            lines.append(f"  {_group_text(key)}: the ranks issued other collectives on it")
            continue
        name = next(iter(heads.values()))[first][0]
        fps = by_ckpt[first]
        detail = "; ".join(
            f"ranks {sorted(r for r in fps if fps[r] == v)}: {_fp_text(v)}"
            for v in sorted(set(fps.values()))
        )
        lines.append(f"  checkpoint '{name}', {_group_text(key)}: {detail}")
    return (
        "the plan agreement of this step failed: the ranks of a process group "
        "recorded other collectives in a checkpoint's forward:\n" + "\n".join(lines)
        + "\n" + fix
    )


def _group_text(key: str) -> str:
    name, _, size = key.rpartition("/")
    return f"process group '{name}' ({size} ranks)"


def _fp_text(v: str) -> str:
    if v == "nothing":
        return "no collective"
    fp, _, count = v.partition(":")
    return f"{count} collective(s), fingerprint {fp}"


_steps: dict[str, StepAgreement] = {}
_namespace = "0"


@atexit.register
def _release_at_exit() -> None:
    # Drop the store clients and the dispatch key while the interpreter is whole:
    # a c10d store freed during interpreter teardown can abort the process.
    _steps.clear()
    set_backward_watch(None)


def reset_step_state(namespace: str) -> None:
    """Forget this process's step state; later rounds use the store key space
    ``namespace``, which must be the same on every rank. For long-lived processes
    that run unrelated jobs in turn (a test harness), or to start clean after an
    error left the ranks' rounds out of step."""
    global _namespace
    _steps.clear()
    set_backward_watch(None)
    _namespace = namespace


def current_step() -> StepAgreement:
    """This process's step machine for the world (made again when the process group
    is destroyed and created again)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    key = str(world.group_name)
    step = _steps.get(key)
    if step is None or step.group is not world:
        step = _steps[key] = StepAgreement(world)
    return step


def mark_step() -> None:
    """Take part in this step's plan agreement even if this rank checkpoints
    nothing in it. ``apply_remat`` calls it from the model's forward; call it once
    per step (e.g. before the forward) where ranks may checkpoint nothing and you
    use ``checkpoint`` directly. A no-op without a process group."""
    if dist_ready():
        current_step().arm()


def check_plan_consistency(group: Any = None) -> None:
    """Run this step's plan agreement now instead of at backward's start.

    Raises :class:`PlanMismatchError` on every rank unless all ran the same
    checkpoints, regions, decisions and collective modes (and recorded the same
    collectives per process group) since the last agreement. Every step is agreed
    anyway before its backward's first collective; calling this (after the forward,
    say) only moves the agreement earlier, so a rank that does not call it still
    meets the others at its backward's start. ``group`` is accepted for
    compatibility: the step group is the world. A no-op without a process group.
    """
    from remat_dist.core import current_frame

    if current_frame() is not None:
        raise PlanMismatchError(
            "remat_dist.check_plan_consistency() was called inside a checkpoint; "
            "call it between steps (or after the forward), on every rank."
        )
    del group
    if not dist_ready():
        return
    step = current_step()
    step._settle_stale()
    if step.phase in (StepPhase.IDLE, StepPhase.ARMED):
        step.agree("check_plan_consistency()")
