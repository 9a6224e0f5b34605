"""``apply_remat(policy=MemoryBudget(...))``: fit a byte budget, lose the least time.

The life of a model under a budget (one state object on the model, see
:class:`_BudgetState`):

1. ``apply_remat`` checkpoints every selected block with full recompute and
   attaches the planner (a forward pre-hook and a forward hook on the model); the
   planner changes blocks only through the ``BlockInstaller`` it was given
   (``remat_dist.wrap``), and its life is a :class:`BudgetPhase`.
2. **Profiling forward** (the first grad-enabled forward of the model). It
   trains normally: every block runs its full-recompute checkpoint, so the
   gradients are those of any other plan. Before it does, each block also runs
   *side passes* on fresh copies of its tensor inputs (an in-place update of an
   input stays in the copy), whose graphs are dropped at once: one per candidate
   (full recompute; each non-empty set of its save regions kept; no checkpoint)
   under a saved-tensor counter, for the candidate's saved bytes, and a few timed
   forwards with the regions timed apart, for recompute times. The RNG states (the
   checkpoints' state hooks plus the CPU generator) and the block's buffers
   (BatchNorm statistics, token counters) are put back after the side passes, so
   the real pass draws the same dropout masks and updates the buffers once. A
   block called more than once per forward adds up the costs of its calls; a
   selected block never called fails the planner (``RematUsageError``). The
   profiling forward runs under a counter too (chained to any saved-tensor hooks of
   the caller), which gives the bytes saved outside the blocks. With
   ``compile=`` every candidate also runs compiled once per block signature,
   for the bytes and recompute time of the compiled block
   (``_profile.CompiledPricing``; with inductor, min-cut levels per block
   too); after each
   forward of the step an after-forward window (``_after``) counts what is saved
   until the next forward: the loss.
3. **The rest of the profiling step** runs full recompute too. Each grad-enabled
   forward of the step is followed until its graph is backpropagated or dropped;
   the most forwards alive at once is the step's **in-flight count** ``k``, as
   the schedule ran it (1 without micro-batches or with gradient accumulation;
   under ``torch.distributed.pipelining``, 1F1B keeps ``p - s`` on stage ``s`` of
   ``p``, GPipe all of them: whatever the schedule did, observed). A backward
   that reaches no parameter (pipelining's shape inference runs
   ``autograd.grad`` for the stage's inputs) is not part of the step: a pre-hook
   on the parameters' ``AccumulateGrad`` nodes tells them apart.
4. **The step ends** at the end of the backward of its latest forward (its
   output's backward, or a replay seen at the next forward when the loss came
   from elsewhere). Only then is the plan made, so nothing is gathered while the
   ranks of a pipeline run different forwards. The ranks that run this model
   alike (the meshes of its DTensor parameters: its TP ranks, its FSDP2 ranks;
   never another pipeline stage, whose meshes are its own; nobody else for a
   model with plain parameters) exchange their tables among themselves
   (``all_gather_objects`` on those groups), take per block and candidate the
   **maximum over those ranks** of bytes and of time, and solve the same
   knapsack (``_solver``) with every byte weighted by ``k``: the plan of least
   recompute time whose peak, ``k x (outside + loss + blocks' bytes)``, fits the
   budget (models sharing the budget: at every moment of their concurrent counts,
   ``_joint``). The plans' digests are compared once more (a
   :class:`PlanMismatchError` if they differ). An infeasible budget raises
   there (naming the model's blocks, ``k``, the peak at full recompute and the
   budget), and so does every later grad-enabled forward.
5. The plan is installed at once (the blocks' checkpoints and save regions are
   rebuilt as a policy dict would build them; blocks planned "none" lose their
   checkpoint); ``current_plan`` returns None until then. Graphs built before
   replay as their forward ran. A profiling forward dropped without a backward
   (a sanity pass) is forgotten, and the next grad-enabled forward profiles
   again. The next grad-enabled forward is counted once more, and a rank whose
   real bytes per forward exceed the budget logs a warning. From then on the
   plan is fixed; the agreement among the ranks at stake
   (``remat_dist.distributed._step``) checks each step as for any other policy.

Cost of the profiling step: per block ``2**r + 1`` extra forwards under the counter
(``r`` save regions; 5 with attention and MLP) and ``repeats`` timed ones, once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import itertools
import json
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat_dist._errors import PlanMismatchError, RematUsageError
from remat_dist._logging import get_logger
from remat_dist._torch._autograd import current_graph_task_id, graph_task_keeps_graph
from remat_dist.budget._after import close_window, open_window
from remat_dist.budget._backward import at_end_of_backward, input_shapes, tensors_in
from remat_dist.budget._config import BlockPlan, BudgetPlan
from remat_dist.budget._joint import ModelTable, moments, peak_of, solve_jointly
from remat_dist.budget._meter import StepMeter
from remat_dist.budget._profile import (
    Candidate,
    CompiledPricing,
    Counter,
    candidates,
    compile_options,
    human,
    min_cut_candidates,
    param_keys,
    profile_block,
)
from remat_dist.core import plain
from remat_dist.distributed import all_gather_objects, dist_ready, own_collectives
from remat_dist.wrap import BlockInstaller, planner_of

if TYPE_CHECKING:
    from remat_dist.budget._budget import MemoryBudget

__all__ = ["BudgetPhase", "RankShare", "current_plan", "live_budgets", "prepare", "stage_name"]

log = get_logger(__name__)


class BudgetPhase(enum.Enum):
    """Where a model under a :class:`MemoryBudget` is in its life."""

    PROFILE = "profile"
    """The next grad-enabled forward profiles the blocks."""
    PROFILING = "profiling"
    """The profiling step runs (full recompute): its first forward runs each
    block's side passes; its forwards are followed until the step ends."""
    WAIT_OTHERS = "wait for the others"
    """Its profiling step has ended; other models sharing its ``MemoryBudget``
    object on this rank have not ended theirs yet (they plan together, at the
    end of the last one's step). Its forwards run full recompute meanwhile."""
    WAIT_FORWARD = "wait for forward"
    """Planned, about to be installed (a moment inside the step's end)."""
    VERIFY = "verify"
    """Installed; the next grad-enabled forward is counted once more."""
    PLANNED = "planned"
    """The plan runs, fixed."""
    FAILED = "failed"
    """The planner cannot go on: every later grad-enabled forward raises ``error``."""
    REMOVED = "removed"
    """``remove_remat`` detached it (a plan pending at a backward's end is dropped)."""


@dataclass
class _Forward:
    """One grad-enabled forward of the profiling step, followed until its graph is
    backpropagated (``done``) or dropped (its checkpoint records all gone, no
    replay since)."""

    records: weakref.WeakSet[Any]
    replays_at: int
    done: bool = False
    profiling: bool = False  # the forward that ran the side passes


@dataclass
class _Planner:
    """The planner attached to one model (``remat_dist.wrap.Planner``)."""

    budget: MemoryBudget
    installer: BlockInstaller
    candidates: list[list[Candidate]]
    phase: BudgetPhase = BudgetPhase.PROFILE
    counter: Counter | None = None
    params: set[Any] = field(default_factory=set)
    table: list[dict[str, tuple[int, float]]] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)  # per block, in the profiling forward
    outside: int = 0  # bytes the profiling forward saved outside the blocks
    after: int = 0  # most bytes saved after one forward of the step (the loss)
    profiling_now: bool = False  # the forward running now runs the side passes
    profiled: bool = False  # the side passes' table is complete
    compiled: CompiledPricing | None = None
    """With ``compile=``: prices the candidates compiled (the profiling forward)."""
    plan: BudgetPlan | None = None
    error: Exception | None = None
    handles: list[Any] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # profiling inputs
    step: list[_Forward] = field(default_factory=list)
    """The profiling step's forwards whose graphs may be alive."""
    in_flight: int = 0
    """The most forwards of the profiling step alive at once, as observed."""
    records_before: set[int] = field(default_factory=set)
    trained_tasks: set[int] = field(default_factory=set)
    """Graph tasks (backward calls) that accumulated into a parameter."""
    grad_hooks: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    groups: list[tuple[tuple[int, ...], Any]] = field(default_factory=list)
    """``(ranks, process group)`` that agree on the plan (:func:`_agreeing_groups`)."""
    shared: _Shared | None = None
    """The models sharing this planner's ``MemoryBudget`` object on this rank."""
    metering: int = 0
    """1 while a forward runs inside the shared step meter."""
    model: Any = None
    """A weak reference to the model (its parameters are not activations)."""

    def detach(self) -> None:
        self.phase = BudgetPhase.REMOVED  # leaves its _Shared's members
        close_window()
        for h in self.handles:
            h.remove()
        self.handles = []
        _drop_grad_hooks(self)

    def go(self, phase: BudgetPhase) -> None:
        self.phase = phase


def prepare(
    budget: MemoryBudget, model: nn.Module, installer: BlockInstaller
) -> Callable[[], _Planner]:
    """Check the budget's regions against the installer's blocks (raising before
    anything changes) and return the call that attaches the planner, once
    ``apply_remat`` has checkpointed every block with full recompute."""
    blocks = installer.blocks
    cands = [candidates(name, module, budget.regions) for name, module in blocks]
    if budget.compile is not False:  # compiled, min-cut may choose within a block
        cands = [cs + min_cut_candidates(budget.compile) for cs in cands]
    owners: dict[int, str] = {}
    for (name, module), cs in zip(blocks, cands):
        for path in sorted({p for c in cs for p in (c.regions or ())}):
            where = f"{name}.{path}"
            first = owners.setdefault(id(module.get_submodule(path)), where)
            if first != where:
                raise RematUsageError(
                    f"remat_dist.MemoryBudget: submodule {where} is also {first} (a "
                    "module shared between blocks); a plan keeping it in both blocks "
                    "would make it a region twice. Fix: give each block its own "
                    "submodule, or pass regions=... without it."
                )
    state = _Planner(budget, installer, cands)

    def attach() -> _Planner:
        state.handles = [
            model.register_forward_pre_hook(functools.partial(_pre_hook, state), prepend=True),
            model.register_forward_hook(functools.partial(_post_hook, state), always_call=True),
        ]
        installer.wrap_runs(functools.partial(_profiled, state))
        state.model = weakref.ref(model)
        state.shared = _shared_of(budget)
        state.shared.add(state)
        return state

    return attach


class RankShare:
    """The slot a :class:`MemoryBudget` object carries for its :class:`_Shared`
    (the models on this rank that share it). Copies made by ``with_regions`` keep
    the slot (still one budget); ``copy.deepcopy`` and pickling give a new, empty
    one (another object: another budget)."""

    __slots__ = ("shared",)

    def __init__(self) -> None:
        self.shared: _Shared | None = None

    def __deepcopy__(self, memo: Any) -> RankShare:
        return RankShare()

    def __reduce__(self) -> tuple[Any, ...]:
        return (RankShare, ())


@dataclass(eq=False)
class _Shared:
    """The models sharing one ``MemoryBudget`` object on this rank: one budget for
    all of them. They plan together when the last of them ends its profiling
    step; with ``measure_peak=True`` one :class:`StepMeter` follows all their
    forwards from then on."""

    budget: MemoryBudget
    refs: list[weakref.ref[_Planner]] = field(default_factory=list)
    """The planners, weakly (a model dropped leaves), in ``apply_remat`` order."""
    meter: StepMeter | None = None
    order: int = field(default_factory=lambda: next(_ORDER))
    concurrent: list[tuple[int, ...]] = field(default_factory=list)
    """At each profiling forward's end, the forwards alive per member (the
    members in ``apply_remat`` order at that moment): the moments the rank's
    peak can fall on."""

    def note_concurrent(self) -> None:
        """Record the forwards alive now, per member: those followed for one
        profiling; its own peak count for one whose step has ended (it is no
        longer followed, and a schedule may run its forwards again in the same
        step: ScheduleDualPipeV's last stage backpropagates each micro-batch
        before the next one's forward); 0 for one not profiling yet."""
        for m in self.members:
            if m.phase is BudgetPhase.PROFILING:
                _settle(m)  # a split backward's weight half may have freed some
        v = tuple(
            sum(not f.done for f in m.step) if m.phase is BudgetPhase.PROFILING
            else max(1, m.in_flight) if m.phase is BudgetPhase.WAIT_OTHERS else 0
            for m in self.members
        )
        if v not in self.concurrent:
            self.concurrent.append(v)

    @property
    def members(self) -> list[_Planner]:
        """The models' planners still attached, in ``apply_remat`` order."""
        alive = [r() for r in self.refs]
        return [p for p in alive if p is not None and p.phase is not BudgetPhase.REMOVED]

    def add(self, state: _Planner) -> None:
        self.refs.append(weakref.ref(state))


_ORDER = itertools.count()


_LIVE: weakref.WeakSet[_Shared] = weakref.WeakSet()
"""Every budget in use on this rank (it empties itself; read by the report)."""


def _shared_of(budget: MemoryBudget) -> _Shared:
    slot = getattr(budget, "_share", None)
    if slot is None:  # pragma: no cover - every MemoryBudget has one
        slot = RankShare()
        object.__setattr__(budget, "_share", slot)
    if slot.shared is None:
        slot.shared = _Shared(budget)
        _LIVE.add(slot.shared)
    return slot.shared


def live_budgets() -> list[_Shared]:
    """The budgets with a model on this rank, in the order they were applied."""
    return sorted((s for s in list(_LIVE) if s.members), key=lambda s: s.order)


def current_plan(model: nn.Module) -> BudgetPlan | None:
    """The plan a :class:`MemoryBudget` chose for ``model`` and runs.

    Args:
        model: a model given a ``MemoryBudget`` by ``apply_remat``.

    Returns:
        The :class:`BudgetPlan`: per block the decision, its bytes and its
        recompute time (maxima over ranks); None until the plan is installed
        (at the end of the profiling step's backward).

    Raises:
        RematUsageError: ``model`` has no memory budget.

    Example::

        plan = remat_dist.budget.current_plan(model)
        if plan is not None:
            print(plan.format())
    """
    state = planner_of(model)
    if not isinstance(state, _Planner):
        raise RematUsageError(
            f"remat_dist.budget.current_plan: {type(model).__name__} has no MemoryBudget. "
            "Fix: apply_remat(model, blocks=..., policy=MemoryBudget(bytes=...))."
        )
    return state.plan if state.phase in (BudgetPhase.VERIFY, BudgetPhase.PLANNED) else None


# -- hooks ------------------------------------------------------------------------


def _pre_hook(state: _Planner, model: nn.Module, args: Any) -> None:
    close_window()  # what the previous forward's loss saved is counted
    if not torch.is_grad_enabled():
        return
    if state.phase is BudgetPhase.FAILED:
        assert state.error is not None
        raise type(state.error)(str(state.error))
    if state.phase is BudgetPhase.WAIT_OTHERS:
        return  # full recompute until the models sharing its budget have planned
    if state.phase is BudgetPhase.PROFILING:
        _settle(state)
        if _step_ended(state):
            # the step ended in a backward that did not go through an output (a
            # loss from an intermediate), or its output had nothing to
            # backpropagate: plan and install before this forward
            _finish_step(state)
        elif not state.profiled:
            log.info(
                "MemoryBudget: the profiling forward was dropped without a backward "
                "(a sanity forward with grad enabled?); this forward profiles again"
            )
            state.go(BudgetPhase.PROFILE)
    if state.phase is BudgetPhase.PROFILE:
        shared = state.shared
        if shared is not None and not any(
            m.phase in (BudgetPhase.PROFILING, BudgetPhase.WAIT_OTHERS) for m in shared.members
        ):
            shared.concurrent = []  # the first of the members to profile (again)
        state.go(BudgetPhase.PROFILING)
        state.after = 0
        state.shapes = input_shapes(args)
        state.table = [{} for _ in state.installer.blocks]
        state.calls = [0 for _ in state.installer.blocks]
        state.step, state.in_flight, state.profiled = [], 0, False
        state.trained_tasks = set()
        options = state.budget.compile
        state.compiled = None if options is False else CompiledPricing(options)
        state.profiling_now = True
    if state.phase is BudgetPhase.PROFILING:
        state.records_before = {id(r) for r in state.installer.live_records()}
        if dist_ready():
            # before FSDP2 unshards (this hook runs first): its parameters are
            # DTensors on their mesh now, and may be plain tensors at the step's end
            _note_groups(state, model)
    meter = state.shared.meter if state.shared is not None else None
    if meter is not None and not state.metering and state.phase in _RUNS_THE_PLAN:
        meter.enter()  # outside the counter below, which chains to it
        state.metering = 1
    if state.profiling_now or state.phase is BudgetPhase.VERIFY:
        state.params = param_keys(model)
        state.counter = Counter(state.params, chain=True)
        state.counter.__enter__()


_RUNS_THE_PLAN = (BudgetPhase.VERIFY, BudgetPhase.PLANNED)


def _post_hook(state: _Planner, model: nn.Module, args: Any, output: Any) -> None:
    metered = bool(state.metering)
    try:
        _post(state, args, output)
    finally:
        if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in tensors_in(output)
        ):
            _open_after(state, metered)


def _open_after(state: _Planner, metered: bool) -> None:
    """Count what this thread saves from now until the next forward of a model
    under a budget (the loss, ``remat_dist.budget._after``): into the
    profiling step's tally, and into the rank's step meter when it runs."""
    sinks: list[Any] = []
    if state.phase is BudgetPhase.PROFILING:
        sinks.append(_AfterTally(state))
    meter = state.shared.meter if state.shared is not None else None
    if metered and meter is not None:
        sinks.append(meter.after_sink())
    open_window(sinks)


class _AfterTally:
    """The bytes one window saves (unique storages, parameters apart); the
    planner keeps the most of any forward of its profiling step."""

    def __init__(self, state: _Planner) -> None:
        self.state = weakref.ref(state)  # a window left open must not keep a model
        self.seen: set[Any] = set()
        self.total = 0

    def saved(self, t: torch.Tensor) -> None:
        state = self.state()
        local = plain(t)
        key = (local.device, local.untyped_storage()._cdata)
        if state is None or key in state.params or isinstance(local, nn.Parameter):
            return None
        if key not in self.seen:
            self.seen.add(key)
            self.total += local.untyped_storage().nbytes()
            state.after = max(state.after, self.total)
        return None

    def release(self, key: Any) -> None:  # pragma: no cover - saved returns None
        pass


def _post(state: _Planner, args: Any, output: Any) -> None:
    counter, state.counter = state.counter, None
    if counter is not None:
        counter.__exit__(None, None, None)
    if state.metering:
        state.metering = 0
        assert state.shared is not None and state.shared.meter is not None
        state.shared.meter.exit()
    if state.phase is BudgetPhase.VERIFY and counter is not None:
        state.go(BudgetPhase.PLANNED)
        _check_measured(state, counter.total, args)
        return
    if state.phase is not BudgetPhase.PROFILING or not torch.is_grad_enabled():
        return
    profiling, state.profiling_now = state.profiling_now, False
    # an always-called hook: after a forward that raised, from inside its handler
    if output is None and sys.exc_info()[0] is not None:
        if profiling:
            state.go(BudgetPhase.PROFILE)  # profile the next step instead
        return
    if profiling:
        assert counter is not None
        blocks = state.installer.blocks
        unused = [name for (name, _), n in zip(blocks, state.calls) if n == 0]
        if unused:
            shown = ", ".join(repr(n) for n in unused[:8]) + (", ..." if len(unused) > 8 else "")
            _fail(state, output, RematUsageError(
                f"remat_dist.MemoryBudget: {len(unused)} selected block(s) never ran in "
                f"the profiling forward: {shown}. The planner needs every block's "
                "measurements, and a block skipped in some steps (layer drop, a "
                "branch) would run a plan made without it. The gradients of this step "
                "are right. Fix: select only the blocks the forward calls in every "
                "step (remove_remat(model), then apply_remat with blocks=... naming "
                "them)."
            ))
            return
        if state.compiled is not None:  # the forward ran the blocks eagerly
            full = sum(state.compiled.eager_full.values())
        else:
            full = sum(row["full"][0] for row in state.table)
        state.outside = max(0, counter.total - full)
        state.profiled = True
    before = state.records_before
    fwd = _Forward(
        records=weakref.WeakSet(
            r for r in state.installer.live_records() if id(r) not in before
        ),
        replays_at=state.installer.replays(),
        profiling=profiling,
    )
    state.step.append(fwd)
    _hook_parameters(state, output)
    if not at_end_of_backward(
        output, functools.partial(_backward_ended, state, fwd), functools.partial(_done, fwd)
    ):
        # no tensor of the output requires grad: a backward, if any, goes through
        # something else (a loss kept on the model); the next forward plans
        fwd.done = True
    state.in_flight = max(state.in_flight, sum(not f.done for f in state.step) or 1)
    if state.shared is not None:
        state.shared.note_concurrent()


def _done(fwd: _Forward) -> None:
    fwd.done = True


def _settle(state: _Planner) -> None:
    """Forget the step's forwards whose graphs died: after a replay since they ran
    (a backward that did not go through their output) they count as done, else as
    dropped without backward. A dropped profiling forward (a sanity pass) makes
    the next forward profile again, on its own batch."""
    keep = []
    for f in state.step:
        if not f.done and not f.records:
            if state.installer.replays() > f.replays_at:
                f.done = True
            else:
                if f.profiling:
                    state.profiled = False
                continue  # dropped
        keep.append(f)
    state.step = keep


def _step_ended(state: _Planner) -> bool:
    """The profiling step has ended when its latest forward is backpropagated: a
    schedule's last backward (1F1B, GPipe: every micro-batch in flight is done by
    then), or the one backward of a step without micro-batches. A graph kept but
    never backpropagated (a sanity forward whose output is held) does not hold
    the plan back; it counts among the forwards alive while it lives."""
    return state.profiled and bool(state.step) and state.step[-1].done


def _backward_ended(state: _Planner, fwd: _Forward) -> None:
    """At the end of a backward through ``fwd``'s output: a backward that reached
    no parameter (``torch.distributed.pipelining``'s shape inference runs one,
    ``autograd.grad`` for the inputs) is not part of the training step; once every
    forward of the profiling step is backpropagated, the step has ended."""
    if state.phase is not BudgetPhase.PROFILING:
        return
    task = current_graph_task_id()
    if state.grad_hooks and task not in state.trained_tasks:
        if graph_task_keeps_graph():
            # the input half of a split backward (ScheduleZBVZeroBubble,
            # ScheduleDualPipeV: autograd.grad for the inputs, retain_graph=True);
            # the graph lives on until its weight half, which frees it (the
            # forward is done once its checkpoint records are gone, _settle)
            fwd.done = False
            return
        state.step = [f for f in state.step if f is not fwd]
        return
    if _step_ended(state):
        _finish_step(state)


def _hook_parameters(state: _Planner, output: Any) -> None:
    """Mark every backward that accumulates into a parameter this forward used
    (a pre-hook on its ``AccumulateGrad`` node, which ``autograd.grad`` for the
    inputs does not run)."""
    # the nodes held while walking: on torch 2.11/2.12 a node's Python object
    # lives only while referenced, and a dropped one's id comes back as another
    # node's (the walk would skip it, and find no parameter)
    seen: dict[int, Any] = {}
    todo = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
    hooks = state.grad_hooks

    def trained(grad_outputs: Any) -> None:
        state.trained_tasks.add(current_graph_task_id())

    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if hasattr(node, "variable"):  # AccumulateGrad
            if id(node) not in hooks:
                hooks[id(node)] = (node, node.register_prehook(trained))
            continue
        todo.extend(n for n, _ in node.next_functions)


def _drop_grad_hooks(state: _Planner) -> None:
    for _, handle in state.grad_hooks.values():
        handle.remove()
    state.grad_hooks = {}


def _finish_step(state: _Planner) -> None:
    """This model's profiling step has ended. When every model sharing its
    budget object on this rank has ended its own (a model alone: at once), plan
    them together (each agreed among the ranks that run it alike), then install
    every plan. An error fails every one of them and is raised here (at the end
    of the last step's backward, or in the next forward); each raises it again
    at its next grad-enabled forward."""
    _drop_grad_hooks(state)
    state.step = []
    state.go(BudgetPhase.WAIT_OTHERS)
    shared = state.shared
    members = shared.members if shared is not None else [state]
    failed = [m for m in members if m.phase is BudgetPhase.FAILED]
    if failed:
        error = RematUsageError(
            f"remat_dist.MemoryBudget: {stage_name(failed[0])} shares this budget "
            f"with {stage_name(state)} and its planner failed ({failed[0].error}); "
            "the models sharing a budget plan together. Fix: the error above, or "
            "give each model its own MemoryBudget object."
        )
        state.go(BudgetPhase.FAILED)
        state.error = error
        raise error
    for m in members:
        if m.phase is BudgetPhase.PROFILING and m is not state:
            _settle(m)  # a split backward's weight half ended its step unseen
            if _step_ended(m):
                _drop_grad_hooks(m)
                m.step = []
                m.go(BudgetPhase.WAIT_OTHERS)
    waiting = [m for m in members if m.phase is not BudgetPhase.WAIT_OTHERS]
    if waiting:
        log.info(
            "MemoryBudget: %s ended its profiling step; the plan waits for %s, which "
            "share(s) its budget on this rank", stage_name(state),
            ", ".join(stage_name(m) for m in waiting),
        )
        return
    try:
        _plan_shared(members)
    except (PlanMismatchError, RematUsageError) as e:
        for m in members:
            m.go(BudgetPhase.FAILED)  # later forwards raise it again
            m.error = e
        raise
    for m in members:
        m.go(BudgetPhase.WAIT_FORWARD)
        _install_plan(m)
    if shared is not None and shared.budget.measure_peak:
        meter = StepMeter()
        for m in members:
            model = m.model() if m.model is not None else None
            if model is not None:
                meter.add_parameters(model)
        shared.meter = meter


def _check_measured(state: _Planner, total: int, args: Any) -> None:
    """The first forward under the plan, counted: warn when, with the loss and
    the forwards in flight, it would not fit the budget, naming the cause."""
    plan = state.plan
    assert plan is not None
    plan.measured_bytes = total
    forward = plan.predicted_bytes - plan.loss_bytes  # what this forward should save
    if plan.in_flight * (total + plan.loss_bytes) <= state.budget.bytes:
        return
    shapes = input_shapes(args)
    if shapes != state.shapes:
        cause = (
            f"the plan was made from the first grad-enabled forward, whose "
            f"inputs had shapes {state.shapes}, and this one's are {shapes} "
            "(a sanity or validation forward with grad enabled on another "
            "batch?). Fix: run such forwards under torch.no_grad(), or re-plan "
            "on the training batch (remove_remat(model), then apply_remat)."
        )
    elif state.budget.compile is not False and total > forward:
        cause = (
            f"the compiled blocks save {human(total - forward)} more per forward "
            "than the plan priced from the compiled side passes of the "
            "profiling step (one per candidate and block signature: a block "
            "that compiles otherwise than the first of its signature, say "
            "through a graph break only it has?). Fix: a budget smaller by "
            f"{plan.in_flight} x that excess."
        )
    else:
        cause = (
            "the blocks share storages with the rest of the model, which "
            "per-block measurement misses. Fix: a smaller budget leaves room."
        )
    log.warning(
        "MemoryBudget: this rank saved %s in the first forward under the plan "
        "(predicted %s, %d forward(s) in flight, the loss %s each), over the budget "
        "of %s: %s",
        human(total), human(forward), plan.in_flight, human(plan.loss_bytes),
        human(state.budget.bytes), cause,
    )


def _fail(state: _Planner, output: Any, error: Exception) -> None:
    """The planner cannot go on: raise ``error`` at the end of the profiling step's
    backward (its gradients are complete), or now when no backward will come; every
    later grad-enabled forward raises it again (``_pre_hook``)."""
    state.go(BudgetPhase.FAILED)
    state.error = error

    def fail() -> None:
        raise type(error)(str(error))

    if not at_end_of_backward(output, fail):
        fail()


# -- profiling --------------------------------------------------------------------


def _profiled(state: _Planner, index: int, run: Any) -> Any:
    installer = state.installer

    def profiled_run(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if state.profiling_now and torch.is_grad_enabled():
            side = installer.side_passes() if installer.side_passes else contextlib.nullcontext()
            with side:
                row = profile_block(
                    installer, index, state.candidates[index], args, kwargs,
                    params=state.params, repeats=state.budget.repeats,
                    compiled=state.compiled,
                )
            # a block called more than once per forward (shared weights): every
            # call saves and recomputes under the same decision, so the costs add
            before = state.table[index]
            state.table[index] = {
                label: (w + before.get(label, (0, 0.0))[0], t + before.get(label, (0, 0.0))[1])
                for label, (w, t) in row.items()
            }
            state.calls[index] += 1
        return run(module, *args, **kwargs)

    return profiled_run


# -- planning ---------------------------------------------------------------------


def _table(state: _Planner, outside: int) -> tuple[ModelTable, list[dict[str, Any]]]:
    """This model's share of the joint problem: this rank's table and those of
    the ranks that run this model alike (:func:`_agreeing_groups`), never across
    pipeline stages; per block and candidate the maxima over those ranks, and of
    the bytes outside the blocks and of the forwards in flight."""
    labels = [[c.label for c in cands] for cands in state.candidates]
    me = _global_rank()
    mine = {
        "rank": me,
        "outside": outside,
        "after": state.after,
        "in_flight": max(1, state.in_flight),
        "labels": labels,
        "table": [[list(row[label]) for label in ls] for row, ls in zip(state.table, labels)],
    }
    groups = _agreeing_groups(state) if dist_ready() else []
    records = {me: mine}
    for group in groups:
        with own_collectives():  # the planner's own exchange, not a collective of the model
            got = all_gather_objects([records[r] for r in sorted(records)], group=group)
        for theirs in got:
            for rec in theirs:
                records.setdefault(rec["rank"], rec)
    ranks = [records[r] for r in sorted(records)]
    for theirs in ranks:
        if theirs["labels"] != labels:
            raise PlanMismatchError(
                f"remat_dist.MemoryBudget: rank {theirs['rank']} has other candidates "
                f"than this rank ({theirs['labels']} vs {labels}): the blocks or their "
                "submodules differ across ranks. Fix: build the same model on every rank."
            )
    costs = [
        [
            (max(int(r["table"][b][c][0]) for r in ranks),
             max(float(r["table"][b][c][1]) for r in ranks))
            for c in range(len(labels[b]))
        ]
        for b in range(len(labels))
    ]
    who = ""
    if len(ranks) > 1:
        per_rank = [
            r["in_flight"] * (
                r["outside"] + r["after"] + sum(min(int(w) for w, _ in blk) for blk in r["table"])
            )
            for r in ranks
        ]
        worst = max(range(len(ranks)), key=lambda i: per_rank[i])
        who = f"rank {ranks[worst]['rank']} needs most: {per_rank[worst]:,} bytes, "
    table = ModelTable(
        name=stage_name(state),
        labels=labels,
        costs=costs,
        outside=max(r["outside"] for r in ranks),
        in_flight=max(r["in_flight"] for r in ranks),
        needs_most=who,
        after=max(r["after"] for r in ranks),
    )
    return table, ranks


def _plan_shared(states: list[_Planner]) -> None:
    """Plan every model sharing one budget object on this rank together (one
    model alone is a problem of one): each model's table agreed among its own
    ranks, one knapsack over all their blocks (``_joint.solve_jointly``), then
    each model's plan, its digest compared among its own ranks."""
    budget = states[0].budget.bytes
    made = [_table(state, state.outside) for state in states]
    tables = [t for t, _ in made]
    shared = states[0].shared
    concurrent = _concurrent(shared, tables)
    choices = solve_jointly(tables, budget, concurrent)
    plans = []
    for state, (table, ranks), choice in zip(states, made, choices):
        costs, k = table.costs, table.in_flight
        blocks = []
        for b, ((name, _), cands) in enumerate(zip(state.installer.blocks, state.candidates)):
            cand = cands[choice[b]]
            w, t = costs[b][choice[b]]
            regions = None if cand.regions is None else {p: "save" for p in cand.regions}
            blocks.append(BlockPlan(
                name=name, decision=cand.label, regions=regions, bytes=w, time_s=t,
                candidates={c.label: costs[b][i] for i, c in enumerate(cands)},
                memory_budget=cand.memory_budget,
            ))
        predicted = table.fixed + sum(b.bytes for b in blocks)
        plans.append(BudgetPlan(
            budget=budget,
            blocks=blocks,
            outside_bytes=table.outside,
            predicted_bytes=predicted,
            predicted_time_s=sum(b.time_s for b in blocks),
            world_size=len(ranks),
            in_flight=k,
            predicted_peak_bytes=k * predicted,
            ranks=tuple(r["rank"] for r in ranks),
            loss_bytes=table.after,
        ))
    per_forward = [p.predicted_bytes for p in plans]
    joint = peak_of(per_forward, concurrent)
    _note_cheaper(plans, per_forward, concurrent, joint)
    for state, plan in zip(states, plans):
        plan.shared_by = len(states)
        plan.rank_peak_bytes = joint
        plan.sum_bound_bytes = sum(p.predicted_peak_bytes for p in plans)
        plan.concurrent = tuple(concurrent)
        digest = hashlib.sha256(json.dumps(plan.decisions()).encode()).hexdigest()[:16]
        for group in _agreeing_groups(state) if dist_ready() else []:
            with own_collectives():
                digests = all_gather_objects(digest, group=group)
            if len(set(digests)) > 1:
                raise PlanMismatchError(
                    "remat_dist.MemoryBudget: the ranks chose different plans from the "
                    f"same measurements (digests by rank: {digests}). This is a bug: "
                    "please report it with the REMAT_DIST_LOG=info output of every rank."
                )
    for state, plan in zip(states, plans):
        state.plan = plan
        shared = (
            f" (one budget with {len(states) - 1} other model(s) on this rank, "
            f"predicted rank peak {human(joint)})" if len(states) > 1 else ""
        )
        log.info("MemoryBudget plan for %s%s, applied from now on:\n%s",
                 stage_name(state), shared, plan.format())


def _note_cheaper(
    plans: list[BudgetPlan], per_forward: list[int],
    concurrent: list[tuple[int, ...]], joint: int,
) -> None:
    """Per block that recomputes, the option of less recompute that adds
    fewest bytes to the rank's peak (``BlockPlan.cheaper``), the other blocks
    as planned: what the plan line shows where budget is left unused."""
    for m, plan in enumerate(plans):
        for i, block in enumerate(plan.blocks):
            best = None
            for label, (w, t) in block.candidates.items():
                if t >= block.time_s:
                    continue
                bytes_now = list(per_forward)
                bytes_now[m] += w - block.bytes
                more = peak_of(bytes_now, concurrent) - joint
                if best is None or (more, t) < (best[2], block.time_s - best[1]):
                    best = (label, block.time_s - t, more)
            if best is not None:
                plan.blocks[i] = dataclasses.replace(block, cheaper=best)


def _concurrent(shared: _Shared | None, tables: list[ModelTable]) -> list[tuple[int, ...]]:
    """The moments the rank's peak can fall on (``_joint.moments``) from the
    forwards alive per model at each profiling forward's end."""
    if shared is None:
        return moments(tables, None)
    return moments(tables, shared.concurrent, shared.budget.plan_against)


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist_ready() else 0


def stage_name(state: _Planner) -> str:
    """The model (a pipeline stage) by its blocks: ``blocks 'layers.2'..'layers.3'``."""
    names = [name for name, _ in state.installer.blocks]
    if not names:
        return "this model"
    if len(names) == 1:
        return f"the model of block {names[0]!r}"
    return f"the model of blocks {names[0]!r}..{names[-1]!r}"


def _agreeing_groups(state: _Planner) -> list[Any]:
    """The process groups whose ranks run this model alike, step by step: every
    dimension of the device meshes of its DTensor parameters (tensor parallel,
    FSDP2), in the order the parameters first name them (the same on every rank),
    as seen at the profiling step's forwards. A pipeline stage's meshes hold its
    own ranks only, so stages plan apart; a model without DTensor parameters
    (plain pipelining, DDP, one rank) plans on its own rank, with nothing of it
    at stake."""
    return [group for _, group in state.groups]


def _note_groups(state: _Planner, model: nn.Module) -> None:
    import torch.distributed as dist

    seen = {ranks for ranks, _ in state.groups}
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is None or not _is_dtensor(p):
            continue
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            ranks = tuple(dist.get_process_group_ranks(group))
            if len(ranks) > 1 and ranks not in seen:
                seen.add(ranks)
                state.groups.append((ranks, group))


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _install_plan(state: _Planner) -> None:
    """Rebuild the blocks' checkpoints as the plan says; the next grad-enabled
    forward is counted once more (``BudgetPlan.measured_bytes``)."""
    plan = state.plan
    assert plan is not None
    if state.phase is not BudgetPhase.WAIT_FORWARD:
        return
    state.go(BudgetPhase.VERIFY)
    state.installer.install(
        {bp.name: None if bp.regions is None else dict(bp.regions) for bp in plan.blocks}
    )
    options = state.budget.compile
    if options is not False:
        # after the plan: each block compiles once, with its checkpoint and
        # save regions as planned (the profiling step ran eagerly)
        for bp, (_, module) in zip(plan.blocks, state.installer.blocks):
            module.compile(**compile_options(options, bp.memory_budget))
