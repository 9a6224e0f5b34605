"""``apply_remat(policy=MemoryBudget(...))``: fit a byte budget, lose the least time.

The life of a model under a budget (one state object on the model, see
:class:`_BudgetState`):

1. ``apply_remat`` checkpoints every selected block with full recompute and
   attaches the planner (a forward pre-hook and a forward hook on the model); the
   planner changes blocks only through the ``BlockInstaller`` it was given
   (``remat_dist.wrap``), and its life is a :class:`BudgetPhase`.
2. **Profiling step** (the first grad-enabled forward of the model). The step
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
   model's forward runs under a counter too (chained to any saved-tensor hooks of
   the caller), which gives the bytes saved outside the blocks.
3. At the end of that forward every rank sends its table to every other
   (``all_gather``), takes per block and candidate the **maximum over ranks** of
   bytes and of time, and solves the same knapsack (``_budget_solver``): every
   rank computes the same plan from the same numbers, and the plans' digests are
   compared once more (a :class:`PlanMismatchError` if they differ, raised at
   once). An infeasible budget is raised at the end of the profiling step's
   backward (or at once when no backward will run), naming the smallest feasible
   budget. Either failure is raised again by every later grad-enabled forward.
4. A profiling forward dropped without a backward (its graph gone, no backward
   started since: a sanity pass) is forgotten, and the next grad-enabled forward
   profiles again. When the first backward after the profiling forward ends
   (through its output, or through a later forward's when that output was kept
   without one) the
   plan is installed (the blocks' checkpoints and save regions are rebuilt as a
   policy dict would build them; blocks planned "none" lose their checkpoint);
   more micro-batches of the profiling step run full recompute until then, and
   ``current_plan`` returns None. An output with no tensor that requires grad
   (the loss kept elsewhere) has no backward to wait for: the plan is installed
   at the next grad-enabled forward. The next grad-enabled forward is counted once
   more, and a rank whose real bytes exceed the budget logs a warning.
   From then on the plan is fixed; the agreement among the ranks at stake
   (``remat_dist.distributed._step``) checks each step as for any other policy.

Cost of the profiling step: per block ``2**r + 1`` extra forwards under the counter
(``r`` save regions; 5 with attention and MLP) and ``repeats`` timed ones, once.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
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
from remat_dist.budget._backward import at_end_of_backward, input_shapes
from remat_dist.budget._config import BlockPlan, BudgetPlan
from remat_dist.budget._profile import (
    Candidate,
    Counter,
    candidates,
    human,
    param_keys,
    profile_block,
)
from remat_dist.budget._solver import solve
from remat_dist.distributed import all_gather_objects, dist_ready
from remat_dist.wrap import BlockInstaller, planner_of

if TYPE_CHECKING:
    from remat_dist.budget._budget import MemoryBudget

__all__ = ["BudgetPhase", "current_plan", "prepare"]

log = get_logger(__name__)


class BudgetPhase(enum.Enum):
    """Where a model under a :class:`MemoryBudget` is in its life."""

    PROFILE = "profile"
    """The next grad-enabled forward profiles the blocks."""
    PROFILING = "profiling"
    """That forward runs: each block's side passes, then its real pass."""
    WAIT_BACKWARD = "wait for backward"
    """Planned; the plan is installed when a backward through the profiling step
    ends (more micro-batches of that step run full recompute until then)."""
    WAIT_FORWARD = "wait for forward"
    """Planned; the profiling forward's output had nothing to backpropagate: the
    plan is installed at the next grad-enabled forward."""
    VERIFY = "verify"
    """Installed; the next grad-enabled forward is counted once more."""
    PLANNED = "planned"
    """The plan runs, fixed."""
    FAILED = "failed"
    """The planner cannot go on: every later grad-enabled forward raises ``error``."""
    REMOVED = "removed"
    """``remove_remat`` detached it (a plan pending at a backward's end is dropped)."""


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
    plan: BudgetPlan | None = None
    error: Exception | None = None
    handles: list[Any] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # profiling inputs
    profile_graph: weakref.WeakSet[Any] | None = None
    """The profiling forward's block records, alive while its graph is; with
    ``backward_seen`` False, an empty set means that forward was dropped without a
    backward, and the next forward profiles again."""
    backward_seen: bool = False
    replays_at_profile: int = 0

    def detach(self) -> None:
        self.phase = BudgetPhase.REMOVED
        for h in self.handles:
            h.remove()
        self.handles = []

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
        return state

    return attach


def current_plan(model: nn.Module) -> BudgetPlan | None:
    """The plan a :class:`MemoryBudget` chose for ``model`` and runs: per block the
    decision, its bytes and its recompute time (maxima over ranks). None until the
    plan is installed (at the end of the profiling step's backward). Raises
    :class:`RematUsageError` when ``model`` has no memory budget."""
    state = planner_of(model)
    if not isinstance(state, _Planner):
        raise RematUsageError(
            f"remat_dist.current_plan: {type(model).__name__} has no MemoryBudget. "
            "Fix: apply_remat(model, blocks=..., policy=MemoryBudget(bytes=...))."
        )
    return state.plan if state.phase in (BudgetPhase.VERIFY, BudgetPhase.PLANNED) else None


# -- hooks ------------------------------------------------------------------------


def _pre_hook(state: _Planner, model: nn.Module, args: Any) -> None:
    if not torch.is_grad_enabled():
        return
    if state.phase is BudgetPhase.FAILED:
        assert state.error is not None
        raise type(state.error)(str(state.error))
    if (
        state.phase is BudgetPhase.WAIT_BACKWARD
        and not state.backward_seen
        and not state.profile_graph
    ):
        if state.installer.replays() > state.replays_at_profile:
            # a backward replayed the blocks without going through the output (a
            # loss taken from an intermediate): it has ended, install now
            _install_plan(state)
        else:
            log.info(
                "MemoryBudget: the profiling forward was dropped without a backward "
                "(a sanity forward with grad enabled?); this forward profiles again"
            )
            state.go(BudgetPhase.PROFILE)
            state.plan = None
    if state.phase is BudgetPhase.WAIT_FORWARD:
        _install_plan(state)
    if state.phase is BudgetPhase.PROFILE:
        state.go(BudgetPhase.PROFILING)
        state.shapes = input_shapes(args)
        state.table = [{} for _ in state.installer.blocks]
        state.calls = [0 for _ in state.installer.blocks]
    if state.phase in (BudgetPhase.PROFILING, BudgetPhase.VERIFY):
        state.params = param_keys(model)
        state.counter = Counter(state.params, chain=True)
        state.counter.__enter__()


def _post_hook(state: _Planner, model: nn.Module, args: Any, output: Any) -> None:
    counter, state.counter = state.counter, None
    if state.phase is BudgetPhase.WAIT_BACKWARD and torch.is_grad_enabled():
        # the plan waits for a backward to end; this forward's backward may be the
        # first (the profiling forward's output was kept without one)
        at_end_of_backward(
            output, functools.partial(_install_plan, state), _backward_seen(state)
        )
    if counter is None:
        return
    counter.__exit__(None, None, None)
    if state.phase is BudgetPhase.VERIFY:
        state.go(BudgetPhase.PLANNED)
        _check_measured(state, counter.total, args)
        return
    if state.phase is not BudgetPhase.PROFILING:
        return
    # an always-called hook: after a forward that raised, from inside its handler
    if output is None and sys.exc_info()[0] is not None:
        state.go(BudgetPhase.PROFILE)  # profile the next step instead
        return
    blocks = state.installer.blocks
    unused = [name for (name, _), n in zip(blocks, state.calls) if n == 0]
    if unused:
        shown = ", ".join(repr(n) for n in unused[:8]) + (", ..." if len(unused) > 8 else "")
        _fail(state, output, RematUsageError(
            f"remat_dist.MemoryBudget: {len(unused)} selected block(s) never ran in the "
            f"profiling forward: {shown}. The planner needs every block's "
            "measurements, and a block skipped in some steps (layer drop, a branch) "
            "would run a plan made without it. The gradients of this step are right. "
            "Fix: select only the blocks the forward calls in every step "
            "(remove_remat(model), then apply_remat with blocks=... naming them)."
        ))
        return
    full = sum(row["full"][0] for row in state.table)
    outside = max(0, counter.total - full)
    try:
        _plan(state, outside)
    except PlanMismatchError as e:
        state.go(BudgetPhase.FAILED)  # later forwards raise it again
        state.error = e
        raise
    except RematUsageError as e:
        _fail(state, output, e)
        return
    state.backward_seen = False
    state.replays_at_profile = state.installer.replays()
    state.profile_graph = weakref.WeakSet(state.installer.live_records())
    if at_end_of_backward(
        output, functools.partial(_install_plan, state), _backward_seen(state)
    ):
        state.go(BudgetPhase.WAIT_BACKWARD)
    else:
        # no tensor of the output requires grad: a backward, if any, goes through
        # something else (a loss kept on the model); before the next forward
        state.go(BudgetPhase.WAIT_FORWARD)


def _check_measured(state: _Planner, total: int, args: Any) -> None:
    """The first step under the plan, counted: warn when it is over budget."""
    assert state.plan is not None
    state.plan.measured_bytes = total
    if total <= state.budget.bytes:
        return
    shapes = input_shapes(args)
    cause = (
        f"the plan was made from the first grad-enabled forward, whose "
        f"inputs had shapes {state.shapes}, and this one's are {shapes} "
        "(a sanity or validation forward with grad enabled on another "
        "batch?). Fix: run such forwards under torch.no_grad(), or re-plan "
        "on the training batch (remove_remat(model), then apply_remat)."
        if shapes != state.shapes
        else "the blocks share storages with the rest of the model, which "
        "per-block measurement misses. Fix: a smaller budget leaves room."
    )
    log.warning(
        "MemoryBudget: this rank saved %s in the first step under the plan, "
        "over the budget of %s (predicted %s): %s",
        human(total), human(state.budget.bytes),
        human(state.plan.predicted_bytes), cause,
    )


def _backward_seen(state: _Planner) -> Callable[[], None]:
    def seen() -> None:
        state.backward_seen = True

    return seen


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
        if state.phase is BudgetPhase.PROFILING and torch.is_grad_enabled():
            side = installer.side_passes() if installer.side_passes else contextlib.nullcontext()
            with side:
                row = profile_block(
                    installer, index, state.candidates[index], args, kwargs,
                    params=state.params, repeats=state.budget.repeats,
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


def _plan(state: _Planner, outside: int) -> None:
    labels = [[c.label for c in cands] for cands in state.candidates]
    mine = {
        "outside": outside,
        "labels": labels,
        "table": [[list(row[label]) for label in ls] for row, ls in zip(state.table, labels)],
    }
    ranks = all_gather_objects(mine) if dist_ready() else [mine]
    for r, theirs in enumerate(ranks):
        if theirs["labels"] != labels:
            raise PlanMismatchError(
                f"remat_dist.MemoryBudget: rank {r} has other candidates than this "
                f"rank ({theirs['labels']} vs {labels}): the blocks or their "
                "submodules differ across ranks. Fix: build the same model on every rank."
            )
    outside_max = max(r["outside"] for r in ranks)
    costs = [
        [
            (max(int(r["table"][b][c][0]) for r in ranks),
             max(float(r["table"][b][c][1]) for r in ranks))
            for c in range(len(labels[b]))
        ]
        for b in range(len(labels))
    ]
    budget = state.budget.bytes
    smallest = outside_max + sum(min(w for w, _ in block) for block in costs)
    if budget < smallest:
        per_rank = [
            r["outside"] + sum(min(int(w) for w, _ in blk) for blk in r["table"])
            for r in ranks
        ]
        worst = max(range(len(ranks)), key=lambda i: per_rank[i])
        who = f"rank {worst} needs most: {per_rank[worst]:,} bytes, " if len(ranks) > 1 else ""
        least = [labels[b][min(range(len(blk)), key=lambda c: blk[c][0])]
                 for b, blk in enumerate(costs)]
        raise RematUsageError(
            f"remat_dist.MemoryBudget: a budget of {budget:,} bytes ({human(budget)}) "
            f"cannot be met: the smallest feasible budget is {smallest:,} bytes "
            f"({human(smallest)}), {_describe_least(least)} ({who}{outside_max:,} "
            "bytes of it outside the blocks). The gradients of this profiling "
            "step are right, but do "
            f"not go on with this budget. Fix: MemoryBudget(bytes={smallest}) or more, "
            "a smaller batch per rank, or finer blocks."
        )
    everything = outside_max + sum(block[-1][0] for block in costs)
    if budget >= everything:
        choice = [len(block) - 1 for block in costs]  # "none" is listed last
    else:
        found = solve(costs, budget - outside_max)
        assert found is not None  # feasible: checked above
        choice = found
    blocks = []
    for b, ((name, _), cands) in enumerate(zip(state.installer.blocks, state.candidates)):
        cand = cands[choice[b]]
        w, t = costs[b][choice[b]]
        regions = None if cand.regions is None else {p: "save" for p in cand.regions}
        blocks.append(BlockPlan(
            name=name, decision=cand.label, regions=regions, bytes=w, time_s=t,
            candidates={c.label: costs[b][i] for i, c in enumerate(cands)},
        ))
    plan = BudgetPlan(
        budget=budget,
        blocks=blocks,
        outside_bytes=outside_max,
        predicted_bytes=outside_max + sum(b.bytes for b in blocks),
        predicted_time_s=sum(b.time_s for b in blocks),
        world_size=len(ranks),
    )
    if dist_ready():
        digest = hashlib.sha256(json.dumps(plan.decisions()).encode()).hexdigest()[:16]
        digests = all_gather_objects(digest)
        if len(set(digests)) > 1:
            raise PlanMismatchError(
                "remat_dist.MemoryBudget: the ranks chose different plans from the "
                f"same measurements (digests by rank: {digests}). This is a bug: "
                "please report it with the REMAT_DIST_LOG=info output of every rank."
            )
    state.plan = plan
    log.info("MemoryBudget plan, applied from the next step:\n%s", plan.format())


def _describe_least(labels: list[str]) -> str:
    """The plan of least bytes in words (its decision per block)."""
    if all(label == "full" for label in labels):
        return "every block recomputed in full"
    counts: dict[str, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    parts = [f"{label!r} for {n} block{'s' if n > 1 else ''}" for label, n in counts.items()]
    return "each block at its fewest bytes: " + ", ".join(parts)


def _install_plan(state: _Planner) -> None:
    """Rebuild the blocks' checkpoints as the plan says; the next grad-enabled
    forward is counted once more (``BudgetPlan.measured_bytes``)."""
    plan = state.plan
    assert plan is not None
    if state.phase not in (BudgetPhase.WAIT_BACKWARD, BudgetPhase.WAIT_FORWARD):
        return
    state.go(BudgetPhase.VERIFY)
    state.installer.install(
        {bp.name: None if bp.regions is None else dict(bp.regions) for bp in plan.blocks}
    )
