"""The plan agreement and the end-of-backward report, among the ranks at stake only.

A checkpoint's replay is at stake on the process groups whose collectives it can
re-issue: the groups of its forward ledger (TP, CP, EP groups; FSDP's group when
the checkpoint contains an FSDP unit). Point-to-point ops never put a group at
stake. A group is known by its ranks (``stake``: the sorted tuple), so two process
groups over the same ranks agree once.

What each rank does, per autograd graph that replays or communicates (a step, or
one micro-batch of a pipeline schedule)::

    forward   each checkpoint's plan joins the pending plan of each of its stakes;
              after join_agreements() (apply_remat calls it) or a checkpoint, the
              groups of collectives issued outside checkpoints are noted too, so
              that a rank that checkpoints nothing still meets its peers
    backward  at the first replay or first collective of the graph task: one
              agreement per stake with a pending plan or a note, in the order of
              the stakes' ranks (a 2-rank stake's posted at a replay's start,
              travelling while the replay computes, and finished before the
              task's first collective or at its end); a mismatch raises
              PlanMismatchError on every rank of that stake before any of them
              issues a collective
    end       one report per stake agreed or replayed in this graph task: a replay
              that diverged or raised on one rank was absorbed there (stand-ins,
              released peers) and every rank of the stake raises
              CollectiveReplayError, before the optimizer step

Nothing at stake (FSDP2 or DDP with checkpoints inside the units): no agreement,
report, operation or store request. The rounds run on a gloo group per stake, made
by the stake's ranks only (``_stake_group``: ``log2(n)`` point-to-point exchanges per round); the
c10d store sees the group's set-up and slow or failed rounds only. Because the
pending plan is keyed by stake and drained by the first graph task that needs it,
several graphs alive at once (pipeline schedules, gradient accumulation) each agree
once, and pipeline stages never wait on each other. A pending plan holds only the
checkpoints whose graph is still alive: a forward whose backward never ran (the
step raised after it, and its loss was dropped) is not agreed on in the next.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from remat_dist._errors import (
    AgreementSetupError,
    CollectiveReplayError,
    PlanMismatchError,
)
from remat_dist._logging import get_logger
from remat_dist._state import register_state
from remat_dist._torch import _autograd, _c10d
from remat_dist.distributed._intercept import set_step_hooks, step_hooks_set
from remat_dist.distributed._plan import PlanDigest, explain
from remat_dist.distributed._ready import dist_ready
from remat_dist.distributed._rounds import AGREE, REPORT, Rounds, Stake
from remat_dist.distributed._stake_group import RoundFailure
from remat_dist.distributed._value_texts import report_error_class

__all__ = [
    "StepState",
    "current_step",
    "join_agreements",
    "reset_step_state",
    "set_replay_timeout",
    "step_stats",
]

log = get_logger(__name__)

REPLAY_TIMEOUT_S = 300.0
"""Default bound (seconds) for an agreement, a report, and each collective a replay
re-issues: torchtitan's default for a job's first collectives, under torch's own
10-minute default, so that remat_dist's error comes before NCCL's watchdog ends
the job, and long enough for a first backward at scale (communicators created
lazily, a straggling rank, checkpoint I/O on one rank)."""

_queue_callback = _autograd.queue_callback
_graph_task_id = _autograd.current_graph_task_id



def set_replay_timeout(seconds: float | None) -> None:
    """Set the bound on what remat_dist issues in backward.

    The bound applies to the rounds remat_dist runs among the ranks of a process
    group whose collectives a replay re-issues (the plan agreement and the
    end-of-backward report), and to each collective a replay re-issues. Past it,
    each rank raises instead of waiting. Every other collective of the step
    (FSDP2's, DDP's, pipeline send/recv, a hook's) keeps its process group's
    timeout.

    Args:
        seconds: the bound; ``None`` restores the default (300 s).

    Returns:
        None.

    Example::

        remat_dist.distributed.set_replay_timeout(60.0)  # every rank, before training
    """
    _PROCESS.timeout = REPLAY_TIMEOUT_S if seconds is None else float(seconds)


def replay_timeout() -> float:
    return _PROCESS.timeout


@dataclass
class _StakeState:
    """One stake's pending plan and note."""

    ranks: Stake
    pending: list[tuple[Any, Any, dict[str, str]]] = field(default_factory=list)
    """Per checkpoint forward since the last agreement: a weak reference to its
    record (alive while its graph is), its plan entry, its fingerprints."""
    noted: bool = False
    agreements: int = 0
    reports: int = 0

    def needs_agreement(self) -> bool:
        return self.noted or bool(self.pending)

    def take_plan(self) -> PlanDigest:
        """The pending plan of the checkpoints whose graph is alive (drained)."""
        plan = PlanDigest()
        for ref, entry, fps in self.pending:
            if ref() is not None:
                plan.add(entry, fps)
        self.pending = []
        return plan


@dataclass
class _Task:
    """One autograd graph task that something at stake took part in."""

    id: int
    report: set[Stake] = field(default_factory=set)
    posted: dict[Stake, Any] = field(default_factory=dict)
    """Agreements posted at a replay's start, by stake: each one's finish, run
    before the task's first collective (or at its end)."""
    failures: list[str] = field(default_factory=list)
    queued: bool = False
    ended: bool = False


@dataclass
class StepStats:
    """What the agreements cost this process so far (:func:`step_stats`).

    Attributes:
        agreements: plan agreements this rank took part in.
        reports: end-of-backward reports this rank took part in.
        operations, store_requests, groups, agreement_wait_s, report_wait_s: below.
    """

    agreements: int = 0
    reports: int = 0
    operations: int = 0
    """Operations this rank ran on its stakes' groups: one per round (a max by
    ``log2(n)`` send/recv exchanges); explaining a mismatch adds two (a max and an
    ``all_gather``)."""
    store_requests: int = 0
    """Requests to the c10d store: group set-up and slow or failed rounds only."""
    groups: int = 0
    """Stake groups this rank made (one per stake, one more after each failure)."""
    agreement_wait_s: float = 0.0
    """Seconds this rank's backward was held finishing its agreements (posted
    when a replay starts, finished before the first collective: what the replay
    computed in between is not counted)."""
    report_wait_s: float = 0.0
    """Seconds this rank's backward was held in its end-of-backward reports
    (mostly waiting for the slowest rank of the stake to end its backward)."""


class StepState:
    """This process's agreements and reports, one per stake (made again when the
    process group is destroyed and created again)."""

    def __init__(self, world: Any, namespace: str) -> None:
        import torch.distributed as dist

        self.world = weakref.ref(world)  # a group alive at exit aborts gloo
        self.rank = dist.get_rank()
        self.rounds = Rounds(self.rank, _c10d.default_store(), namespace)
        self.stakes: dict[Stake, _StakeState] = {}
        self.task: _Task | None = None
        self.owed: _Task | None = None
        self.noting = False
        self.stats = StepStats()
        self.announced = False  # "nothing at stake" said once (REMAT_DIST_LOG=info)
        self.quiet: tuple[int, list[str]] = (-1, [])
        """The graph task whose replays with nothing at stake are being counted,
        and their checkpoints' names."""
        self.full = PlanDigest()  # every checkpoint since check_plan_consistency()
        self.condemned: list[Any] = []
        """Weak references to the records of a forward whose plan check raised on
        this rank: a backward through one of them raises before its first
        collective; once they died (the step was dropped) they are forgotten."""
        # backward may run on the engine's device threads: one transition at a time
        self._lock = threading.RLock()

    # -- forward
    def arm(self) -> None:
        """Note the groups of the collectives issued from now on in this forward
        (``join_agreements``, a checkpoint's start)."""
        self._settle_owed()
        if not self.noting:
            self.noting = True
            self._hooks()

    def note(self, stake: Stake) -> None:
        """A collective on the ranks ``stake`` was issued in forward, outside any
        checkpoint, while armed."""
        if len(stake) > 1 and self.rank in stake:
            state = self._stake(stake)
            if not state.noted:
                state.noted = True
                self._hooks()

    def add_checkpoint(
        self, record: Any, entry: list[Any], by_stake: dict[Stake, dict[str, str]]
    ) -> None:
        """A checkpoint's forward ended: ``entry`` is its plan, ``by_stake`` its
        ledger's fingerprint per process group, grouped by the groups' ranks;
        ``record`` (held weakly) lives as long as its graph."""
        self.full.add(
            entry, {k: v for fps in by_stake.values() for k, v in fps.items()}
        )
        ref = None
        for stake, fps in by_stake.items():
            if len(stake) > 1 and self.rank in stake:
                ref = ref or weakref.ref(record)
                self._stake(stake).pending.append((ref, entry, fps))
        if by_stake:
            self._hooks()

    def _stake(self, stake: Stake) -> _StakeState:
        state = self.stakes.get(stake)
        if state is None:
            state = self.stakes[stake] = _StakeState(stake)
        return state

    def plan_check_failed(self) -> None:
        """``check_plan_consistency()`` raised here: this rank's pending plans are
        not agreed on (the step is dropped on every rank that took part), and a
        backward through them raises before its first collective."""
        for state in self.stakes.values():
            self.condemned.extend(
                ref for ref, _, _ in state.pending if ref() is not None
            )
            state.pending, state.noted = [], False
        self.noting = False
        self._hooks()

    # -- backward
    def in_backward(self) -> None:
        """Before every collective of a backward: agree if this graph task has not
        (the collective itself keeps its group's timeout: only what a replay
        re-issues carries the bound, set by the replay's verifier)."""
        task = self.task
        if task is None or task.id != _graph_task_id() or task.posted:
            with self._lock:  # backward may run on several engine threads
                task = self.task
                if task is None or task.id != _graph_task_id():
                    task = self._begin()
                self._finish_agreements(task)

    def replay_starts(self, stakes: tuple[Stake, ...]) -> None:
        """A replay of a checkpoint at stake on ``stakes`` starts: if this graph
        task has not agreed yet, post its agreements, to be finished before its
        first collective (the replay computes meanwhile; stakes of more than 2
        ranks finish at once); its stakes report at this task's end."""
        with self._lock:
            task = self.task
            if task is None or task.id != _graph_task_id():
                task = self._begin()
                if any(len(stake) > 2 for stake in task.posted):
                    # past 2 ranks a round needs every member's later exchanges:
                    # a rank that raised between post and finish would leave its
                    # peers split on whether the round completed
                    self._finish_agreements(task)
            mine = [s for s in stakes if len(s) > 1 and self.rank in s]
            if mine:
                task.report.update(mine)
                self._queue_end(task)

    def fail(self, message: str) -> None:
        """This rank's replay failed and was absorbed: the graph task must fail."""
        task = self.task
        if task is not None:
            task.failures.append(message)

    def _begin(self) -> _Task:
        tid = _graph_task_id()
        previous = self.task
        if previous is not None and not previous.ended and (
            previous.report or previous.posted
        ):
            self.owed = previous  # it raised before its end
        self._settle_owed()
        task = self.task = _Task(tid)
        condemned, self.condemned = self.condemned, []
        if any(ref() is not None for ref in condemned):
            self._hooks()
            raise PlanMismatchError(
                f"rank {self.rank}: this backward runs a forward whose "
                "check_plan_consistency() raised on this rank; its replays cannot "
                "be agreed on. Fix: drop the step (do not call backward after the "
                "check raised; zero the gradients) and run the next one."
            )
        # plans of graphs that died unreplayed (a step that raised after its
        # forward) are dropped alike on every rank: no agreement for them alone
        plans = {
            s: (st.take_plan(), st.noted)
            for s, st in sorted(self.stakes.items())
            if st.needs_agreement()
        }
        need = [s for s, (plan, noted) in plans.items() if plan.count or noted]
        self.noting = False
        if not need:
            self._hooks()
            return task
        for stake in need:
            task.posted[stake] = self._post_agreement(stake, plans[stake][0])
        self._queue_end(task)
        self._hooks()
        return task

    def _finish_agreements(self, task: _Task, quiet: bool = False) -> None:
        """Finish ``task``'s posted agreements, in the stakes' order: a stake that
        agreed reports at the task's end; the first mismatch or set-up failure
        raises (none with ``quiet``: the task already failed)."""
        errors: list[BaseException] = []
        t0 = time.perf_counter()
        try:
            # emptied only once finished: another engine thread about to issue
            # a collective waits on the lock until then
            for stake, finish in task.posted.items():
                try:
                    finish()
                    task.report.add(stake)
                except (PlanMismatchError, AgreementSetupError) as e:
                    task.report.discard(stake)
                    errors.append(e)
        finally:
            task.posted = {}
        self.stats.agreement_wait_s += time.perf_counter() - t0
        self._hooks()
        if errors and not quiet:
            raise errors[0]

    def _queue_end(self, task: _Task) -> None:
        if not task.queued and _graph_task_id() != -1:
            task.queued = True
            _queue_callback(lambda: self._end(task))

    # -- the rounds
    def run_round(
        self, stake: Stake, kind: int, words: list[int], explain_with: Callable[[], bytes]
    ) -> dict[int, bytes] | None:
        """One round among ``stake`` now, bounded by the replay timeout
        (:meth:`Rounds.post`)."""
        self._stake(stake)
        return self.rounds.post(stake, kind, words, explain_with, _PROCESS.timeout)()

    def round_error(
        self, stake: Stake, f: RoundFailure, what: str, kind: type
    ) -> Exception:
        """The error every rank raises for a round that failed (:meth:`Rounds.error`)."""
        return self.rounds.error(stake, f, what, kind, _PROCESS.timeout)

    def announce_nothing_at_stake(self, name: str) -> None:
        """Count a replay that runs with nothing at stake; the first backward
        that has any says, once per process, how many it had."""
        if self.announced:
            return
        tid = _graph_task_id()
        if self.quiet[0] != tid:
            self.quiet = (tid, [])
            if tid != -1:
                _queue_callback(self._say_nothing_at_stake)
        self.quiet[1].append(name)

    def _say_nothing_at_stake(self) -> None:
        if self.announced:
            return
        self.announced = True
        names = self.quiet[1]
        shown = ", ".join(f"'{n}'" for n in names[:3]) + (", ..." if len(names) > 3 else "")
        log.info(
            "%d checkpoint(s) replayed in this backward in no replay group (%s): "
            "their forwards issued no collective of their own, so they need no "
            "agreement, gloo operation or store request",
            len(names),
            shown,
        )

    def _post_agreement(self, stake: Stake, plan: PlanDigest) -> Any:
        """Post the plan agreement of ``stake``; returns its finish, which raises
        :class:`PlanMismatchError` (or :class:`AgreementSetupError`) on every rank
        of the stake where the plans differ or the round failed."""
        state = self.stakes[stake]
        state.noted = False
        if state.agreements == 0:
            log.info(
                "ranks %s form a replay group (replays re-issue collectives on them): each "
                "backward pass that replays on them runs one plan agreement and one "
                "end-of-backward report on a gloo group of these ranks (one per "
                "micro-batch under pipeline schedules, one per backward half under "
                "split backward)",
                list(stake),
            )
        state.agreements += 1
        self.stats.agreements += 1
        what = f"the plan agreement of ranks {list(stake)}"
        round_ = self.rounds.post(
            stake, AGREE, plan.words(), plan.payload, _PROCESS.timeout
        )

        def finish() -> None:
            try:
                got_all = round_()
            except RoundFailure as f:
                raise self.round_error(stake, f, what, PlanMismatchError) from None
            if got_all is None:
                round_s, wait_s = self.rounds.last_times(stake)
                log.info(
                    "%s: %d checkpoint(s) agreed in %.2f ms from its post, %.2f ms "
                    "of it waiting",
                    what,
                    plan.count,
                    round_s * 1e3,
                    wait_s * 1e3,
                )
                return
            text = explain({r: json.loads(v) for r, v in got_all.items()}, what)
            log.error("%s", text)
            raise PlanMismatchError(text)

        return finish

    def _end(self, task: _Task) -> None:
        with self._lock:
            task.ended = True
            if self.owed is task:
                self.owed = None
            failure = task.failures[0] if task.failures else None
            errors: list[Exception] = []
            try:
                try:
                    self._finish_agreements(task)
                except (PlanMismatchError, AgreementSetupError) as e:
                    errors.append(e)
                try:
                    self._report(task, failure)
                except Exception as e:  # noqa: BLE001 - raised after the agreement's
                    errors.append(e)
            finally:
                self._hooks()
            if errors:
                raise errors[0]

    def _report(self, task: _Task, failure: str | None) -> None:
        errors: list[BaseException] = []
        for stake in sorted(task.report):
            state = self.stakes.get(stake)
            if state is None:
                continue
            state.reports += 1
            self.stats.reports += 1
            # [failed, 0]: the maximum says whether any rank failed
            flags = [0, 0] if failure is None else [1, 0]
            what = f"the end-of-backward report of ranks {list(stake)}"
            t0 = time.perf_counter()
            try:
                msgs = self.run_round(
                    stake, REPORT, flags, (failure or "").encode
                )
            except RoundFailure as f:
                errors.append(self.round_error(stake, f, what, CollectiveReplayError))
                continue
            finally:
                self.stats.report_wait_s += time.perf_counter() - t0
            if msgs is None:
                continue
            failed = sorted(r for r, m in msgs.items() if m)
            reports = "\n".join(f"[rank {r}] {msgs[r].decode()}" for r in failed)
            # a replay that computed other values (determinism_check="values")
            kind = report_error_class(msgs[r].decode() for r in failed)
            err = kind(
                f"the replay diverged or failed on ranks {failed}; every rank of "
                f"{list(stake)} stops at the end of backward (the gradients of this "
                f"step are wrong: do not step the optimizer).\n{reports}"
            )
            err.failed_ranks = failed  # type: ignore[attr-defined]
            log.error("%s", err)
            errors.append(err)
        if errors:
            raise errors[0]

    def _settle_owed(self) -> None:
        """A graph task that raised never reached its end: take part in its reports
        (saying so) so that the stakes' rounds stay aligned."""
        owed, self.owed = self.owed, None
        if owed is None:
            task = self.task
            if (
                task is None
                or task.ended
                or not (task.report or task.posted)
                or _graph_task_id() != -1
            ):
                return
            owed = task
        owed.ended = True
        self._finish_agreements(owed, quiet=True)
        try:
            self._report(
                owed, f"rank {self.rank}: backward raised before the end of the step"
            )
        except (CollectiveReplayError, AgreementSetupError):
            pass

    def _hooks(self) -> None:
        """Intercept collectives only while something needs it."""
        active = (
            self.noting
            or bool(self.condemned)
            or any(s.needs_agreement() for s in self.stakes.values())
            or (
                self.task is not None
                and bool(self.task.report or self.task.posted)
                and not self.task.ended
            )
        )
        if active:
            set_step_hooks(self.in_backward, self.note if self.noting else None)
        else:
            set_step_hooks(None, None)

    def close(self) -> None:
        self.rounds.close()


@dataclass
class _StepProcess:
    """This process's agreement state, the store key space its rounds use, and the
    bound on them (what ``reset_process_state`` puts back)."""

    state: StepState | None = None
    namespace: str = "0"
    timeout: float = REPLAY_TIMEOUT_S

    def close(self) -> None:
        """Drop the stakes' gloo groups and the dispatch hooks."""
        if self.state is not None:
            self.state.close()
        self.state = None
        set_step_hooks(None, None)

    def reset(self) -> None:
        self.close()
        self.timeout = REPLAY_TIMEOUT_S


_PROCESS = register_state("distributed.step", _StepProcess())


def release_process_state() -> None:
    """Drop the stakes' gloo groups and the dispatch hooks (at interpreter exit,
    while the interpreter is whole: a gloo group freed in finalization aborts)."""
    _PROCESS.close()


def reset_step_state(namespace: str) -> None:
    """Forget this process's agreement state and drop its stake groups; later
    rounds use the store key space ``namespace``, which must be the same on every
    rank. For long-lived processes that run unrelated jobs in turn (a test
    harness), or to start clean after an error left the ranks out of step."""
    _PROCESS.close()
    _PROCESS.namespace = namespace


def current_step() -> StepState:
    """This process's agreement state (made again for a new default process group)."""
    world = _c10d.default_group()
    state = _PROCESS.state
    if state is None or state.world() is not world:
        if state is not None:
            state.close()
        state = _PROCESS.state = StepState(world, _PROCESS.namespace)
    return state


def checkpoint_forward_starts() -> StepState | None:
    """:func:`current_step` at a checkpoint's forward: settles owed reports, stale
    hooks. None without a process group."""
    if (world := _c10d.default_group()) is None:
        return None
    state = _PROCESS.state
    if state is None or state.world() is not world:
        state = current_step()
    if state.owed is not None or state.task is not None:
        state._settle_owed()
    if step_hooks_set():
        state._hooks()
    return state


def step_stats() -> StepStats:
    """What the agreements and reports cost this process so far.

    Returns:
        A :class:`StepStats` snapshot: rounds, gloo operations issued, store
        requests (group set-up and failed rounds only), gloo groups made, and the
        seconds backward waited in the rounds.

    Example::

        before = remat_dist.distributed.step_stats()
        loss.backward()
        after = remat_dist.distributed.step_stats()
        print(after.agreements - before.agreements, after.store_requests)
    """
    state = _PROCESS.state
    if state is None:
        return StepStats()
    rounds = state.rounds
    rounds.count()
    stats = StepStats(**vars(state.stats))
    stats.operations, stats.store_requests = rounds.operations, rounds.store_requests
    stats.groups = rounds.made
    return stats


def join_agreements() -> None:
    """Take part in the agreements of this forward even if this rank checkpoints
    nothing in it.

    The process groups of the collectives this rank issues from now on in this
    forward (outside FSDP2's own and point-to-point) form replay groups for it, so
    a rank-dependent policy raises on the ranks concerned instead of leaving a
    peer waiting. ``apply_remat`` calls it from the model's forward; call it once
    per forward where ranks may checkpoint nothing and you use ``checkpoint``
    directly. A no-op without a process group.

    Returns:
        None.

    Example::

        def forward(self, x):
            remat_dist.distributed.join_agreements()
            for i, block in enumerate(self.blocks):
                if i in self.checkpointed:
                    x = remat_dist.checkpoint(region_name=f"blocks.{i}")(block)(x)
                else:
                    x = block(x)
            return x
    """
    if dist_ready() and torch.is_grad_enabled():
        current_step().arm()
