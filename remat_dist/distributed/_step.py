"""The plan agreement and the end-of-backward report, among the ranks at stake only.

A checkpoint's replay is at stake on the process groups whose collectives it can
re-issue: the groups of its forward ledger (TP, CP, EP groups; FSDP's group when
the checkpoint contains an FSDP unit). Point-to-point ops never put a group at
stake. A group is known by its ranks (``stake``: the sorted tuple), so two process
groups over the same ranks agree once.

What each rank does, per autograd graph that replays or communicates (a step, or
one micro-batch of a pipeline schedule)::

    forward   each checkpoint's plan joins the pending plan of each of its stakes;
              after mark_step() (apply_remat calls it) or a checkpoint, the groups
              of collectives issued outside checkpoints are noted too, so that a
              rank that checkpoints nothing still meets its peers
    backward  at the first replay or first collective of the graph task: one
              agreement per stake with a pending plan or a note, in the order of
              the stakes' ranks; a mismatch raises PlanMismatchError on every
              rank of that stake before any of them issues a collective
    end       one report per stake agreed or replayed in this graph task: a replay
              that diverged or raised on one rank was absorbed there (stand-ins,
              released peers) and every rank of the stake raises
              CollectiveReplayError, before the optimizer step

Nothing at stake (FSDP2 or DDP with checkpoints inside the units): no agreement,
report, message or store request. The rounds run on a side channel per stake
(``_channel``: direct links among its ranks, ``log2(n)`` hops); the c10d store
sees the channel's setup and slow or failed rounds only. Because the
pending plan is keyed by stake and drained by the first graph task that needs it,
several graphs alive at once (pipeline schedules, gradient accumulation) each agree
once, and pipeline stages never wait on each other.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from remat_dist._errors import CollectiveReplayError, PlanMismatchError
from remat_dist._logging import get_logger
from remat_dist._state import register_state
from remat_dist._torch import _autograd, _c10d
from remat_dist.distributed._channel import (
    ChannelFailure,
    SideChannel,
    all_equal,
    check_tag,
    tagged_words,
)
from remat_dist.distributed._intercept import set_step_hooks, step_hooks_set
from remat_dist.distributed._plan import PlanDigest, explain, failure_text
from remat_dist.distributed._ready import dist_ready
from remat_dist.distributed._value_texts import report_error_class

__all__ = [
    "StepState",
    "current_step",
    "mark_step",
    "reset_step_state",
    "set_replay_timeout",
    "step_stats",
]

log = get_logger(__name__)

REPLAY_TIMEOUT_S = 20.0
"""Default bound (seconds) for an agreement, a report, and each replayed collective."""

_queue_callback = _autograd.queue_callback
_graph_task_id = _autograd.current_graph_task_id

Stake = tuple[int, ...]

_AGREE, _REPORT = 1, 2


def set_replay_timeout(seconds: float) -> None:
    """Bound (seconds) for the ranks at stake to reach an agreement or report, and
    for each collective of a backward that replays; past it, each rank raises
    instead of waiting. Call it on every rank before training."""
    _PROCESS.timeout = float(seconds)


def replay_timeout() -> float:
    return _PROCESS.timeout


@dataclass
class _StakeState:
    """One stake's pending plan, note and side channel."""

    ranks: Stake
    pending: PlanDigest = field(default_factory=PlanDigest)
    noted: bool = False
    rounds: int = 0
    """Rounds run (on every member alike): a channel is named by the round it
    was made for, so members that replace a failed one meet on the new one."""
    channel: SideChannel | None = None
    agreements: int = 0
    reports: int = 0

    def needs_agreement(self) -> bool:
        return self.noted or self.pending.count > 0


@dataclass
class _Task:
    """One autograd graph task that something at stake took part in."""

    id: int
    report: set[Stake] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)
    queued: bool = False
    ended: bool = False


@dataclass
class StepStats:
    """What the agreement cost this process so far (``step_stats()``)."""

    agreements: int = 0
    reports: int = 0
    messages: int = 0
    store_requests: int = 0
    channels: int = 0


class StepState:
    """This process's agreements and reports, one per stake (made again when the
    process group is destroyed and created again)."""

    def __init__(self, world: Any, namespace: str) -> None:
        import torch.distributed as dist

        self.world = weakref.ref(world)  # a group alive at exit aborts gloo
        self.namespace = namespace
        self.rank = dist.get_rank()
        self.store = _c10d.default_store()
        self.stakes: dict[Stake, _StakeState] = {}
        self.task: _Task | None = None
        self.owed: _Task | None = None
        self.noting = False
        self.stats = StepStats()
        self.full = PlanDigest()  # every checkpoint since check_plan_consistency()
        self.checks: dict[str, Any] = {}
        """Per group name: its ``check_plan_consistency`` store round (``_check``)."""
        # backward may run on the engine's device threads: one transition at a time
        self._lock = threading.RLock()

    # -- forward
    def arm(self) -> None:
        """Note the groups of the collectives issued from now on in this forward
        (``mark_step``, a checkpoint's start)."""
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
        self, entry: list[Any], by_stake: dict[Stake, dict[str, str]]
    ) -> None:
        """A checkpoint's forward ended: ``entry`` is its plan, ``by_stake`` its
        ledger's fingerprint per process group, grouped by the groups' ranks."""
        self.full.add(
            entry, {k: v for fps in by_stake.values() for k, v in fps.items()}
        )
        for stake, fps in by_stake.items():
            if len(stake) > 1 and self.rank in stake:
                self._stake(stake).pending.add(entry, fps)
        if by_stake:
            self._hooks()

    def _stake(self, stake: Stake) -> _StakeState:
        state = self.stakes.get(stake)
        if state is None:
            state = self.stakes[stake] = _StakeState(stake)
        return state

    # -- backward
    def in_backward(self) -> float | None:
        """Before every collective of a backward: agree if this graph task has not;
        returns the bound (seconds) for the collective, None when nothing of this
        graph task is at stake."""
        task = self.task
        if task is None or task.id != _graph_task_id():
            with self._lock:
                task = self._begin()
        return _PROCESS.timeout if task.report else None

    def replay_starts(self, stakes: tuple[Stake, ...]) -> None:
        """A replay of a checkpoint at stake on ``stakes`` starts (agree first if
        this graph task has not); its stakes report at this task's end."""
        with self._lock:
            task = self.task
            if task is None or task.id != _graph_task_id():
                task = self._begin()
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
        if previous is not None and previous.report and not previous.ended:
            self.owed = previous  # it raised before its end
        self._settle_owed()
        task = self.task = _Task(tid)
        need = sorted(s for s, st in self.stakes.items() if st.needs_agreement())
        self.noting = False
        if not need:
            self._hooks()
            return task
        errors: list[BaseException] = []
        for stake in need:
            try:
                self._agree(stake)
                task.report.add(stake)
            except PlanMismatchError as e:
                errors.append(e)
        if task.report:
            self._queue_end(task)
        self._hooks()
        if errors:
            raise errors[0]
        return task

    def _queue_end(self, task: _Task) -> None:
        if not task.queued and _graph_task_id() != -1:
            task.queued = True
            _queue_callback(lambda: self._end(task))

    # -- the rounds
    def _make_channel(self, state: _StakeState, index: int) -> SideChannel:
        digest = hashlib.sha1(",".join(map(str, state.ranks)).encode()).hexdigest()[:12]
        key = f"remat_dist/ch/{self.namespace}/{digest}/{index}"
        state.channel = None
        ch = SideChannel(state.ranks, self.rank, self.store, key, _PROCESS.timeout)
        state.channel = ch
        self.stats.channels += 1
        return ch

    def _count(self, ch: SideChannel) -> None:
        self.stats.messages += ch.messages
        self.stats.store_requests += ch.store_requests
        ch.messages = ch.store_requests = 0

    def _round(self, state: _StakeState, fn: Any) -> Any:
        """Run ``fn(channel)`` as this stake's next round; a channel aborted in a
        round this rank completed is replaced and the round run again on the new
        one (where the rank that aborted meets it)."""
        index = state.rounds
        state.rounds += 1
        for attempt in range(2):
            ch = state.channel
            if ch is None or ch.broken:
                ch = self._make_channel(state, index)
            try:
                return fn(ch)
            except ChannelFailure as f:
                if not (f.stale and attempt == 0):
                    raise
            finally:
                self._count(ch)
        raise AssertionError("unreachable")

    def _agree(self, stake: Stake) -> None:
        state = self.stakes[stake]
        plan, state.pending, state.noted = state.pending, PlanDigest(), False
        words = plan.words()
        state.agreements += 1
        self.stats.agreements += 1
        what = f"the plan agreement of ranks {list(stake)}"
        try:
            got = self._round(
                state,
                lambda ch: ch.reduce_max(tagged_words(_AGREE, words), _PROCESS.timeout),
            )
            check_tag(got, _AGREE, stake)
            if all_equal(got[2:], words):
                log.info(
                    "%s: %d checkpoint(s) agreed in %.2f ms (%d side-channel "
                    "messages by this rank so far)",
                    what,
                    plan.count,
                    state.channel.last_round_s * 1e3 if state.channel else 0.0,
                    self.stats.messages,
                )
                return
            got_all = self._round(
                state, lambda ch: ch.gather(plan.payload(), _PROCESS.timeout)
            )
        except ChannelFailure as f:
            text = failure_text(self.rank, stake, f, what, _PROCESS.timeout)
            log.error("%s", text)
            raise PlanMismatchError(text) from None
        text = explain({r: json.loads(v) for r, v in got_all.items()}, what)
        log.error("%s", text)
        raise PlanMismatchError(text)

    def _end(self, task: _Task) -> None:
        with self._lock:
            task.ended = True
            if self.owed is task:
                self.owed = None
            failure = task.failures[0] if task.failures else None
            try:
                self._report(task, failure)
            finally:
                self._hooks()

    def _report(self, task: _Task, failure: str | None) -> None:
        errors: list[BaseException] = []
        for stake in sorted(task.report):
            state = self.stakes.get(stake)
            if state is None:
                continue
            state.reports += 1
            self.stats.reports += 1
            flag = 0 if failure is None else 1
            what = f"the end-of-backward report of ranks {list(stake)}"
            try:
                got = self._round(
                    state,
                    lambda ch, f=flag: ch.reduce_max(
                        tagged_words(_REPORT, [f]), _PROCESS.timeout
                    ),
                )
                check_tag(got, _REPORT, stake)
                if got[2] == 0:
                    continue
                msg = (failure or "").encode()
                msgs = self._round(
                    state, lambda ch, m=msg: ch.gather(m, _PROCESS.timeout)
                )
            except ChannelFailure as f:
                text = failure_text(self.rank, stake, f, what, _PROCESS.timeout)
                log.error("%s", text)
                errors.append(CollectiveReplayError(text))
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
            if task is None or not task.report or task.ended or _graph_task_id() != -1:
                return
            owed = task
        owed.ended = True
        try:
            self._report(
                owed, f"rank {self.rank}: backward raised before the end of the step"
            )
        except (CollectiveReplayError, PlanMismatchError):
            pass

    def _hooks(self) -> None:
        """Intercept collectives only while something needs it."""
        active = (
            self.noting
            or any(s.needs_agreement() for s in self.stakes.values())
            or (
                self.task is not None and bool(self.task.report) and not self.task.ended
            )
        )
        if active:
            set_step_hooks(self.in_backward, self.note if self.noting else None)
        else:
            set_step_hooks(None, None)

    def close(self) -> None:
        for state in self.stakes.values():
            if state.channel is not None:
                self._count(state.channel)
                state.channel.close()
                state.channel = None


@dataclass
class _StepProcess:
    """This process's agreement state, the store key space its rounds use, and the
    bound on them (what ``reset_process_state`` puts back)."""

    state: StepState | None = None
    namespace: str = "0"
    timeout: float = REPLAY_TIMEOUT_S

    def close(self) -> None:
        """Close the side channels and drop the dispatch hooks."""
        if self.state is not None:
            self.state.close()
        self.state = None
        set_step_hooks(None, None)

    def reset(self) -> None:
        self.close()
        self.timeout = REPLAY_TIMEOUT_S


_PROCESS = register_state("distributed.step", _StepProcess())


def release_process_state() -> None:
    """Close the side channels and drop the dispatch hooks (at interpreter exit)."""
    _PROCESS.close()


def reset_step_state(namespace: str) -> None:
    """Forget this process's agreement state and close its side channels; later
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
    """What the agreements and reports cost this process so far: rounds, side-channel
    messages sent, store requests (channel set-up and slow rounds only)."""
    state = _PROCESS.state
    if state is None:
        return StepStats()
    for s in state.stakes.values():
        if s.channel is not None:
            state._count(s.channel)
    return StepStats(**vars(state.stats))


def mark_step() -> None:
    """Take part in the agreements of this step's forward even if this rank
    checkpoints nothing in it: the process groups of the collectives it issues
    from now on (outside FSDP2's own and point-to-point) are at stake.
    ``apply_remat`` calls it from the model's forward; call it once per forward
    where ranks may checkpoint nothing and you use ``checkpoint`` directly. A
    no-op without a process group."""
    if dist_ready() and torch.is_grad_enabled():
        current_step().arm()
