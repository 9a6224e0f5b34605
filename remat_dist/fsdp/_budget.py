"""``apply_remat(policy=MemoryBudget(...))``: fit a byte budget, lose the least time.

The life of a model under a budget (one state object on the model, see
:class:`_BudgetState`):

1. ``apply_remat`` checkpoints every selected block with full recompute and
   attaches the planner (a forward pre-hook and a forward hook on the model).
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
   From then on the plan is fixed; the per-step plan agreement
   (``remat_dist.distributed._step``) checks each step as for any other policy.

Cost of the profiling step: per block ``2**r + 1`` extra forwards under the counter
(``r`` save regions; 5 with attention and MLP) and ``repeats`` timed ones, once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat_dist._logging import get_logger
from remat_dist.distributed import all_gather_objects, dist_ready
from remat_dist.errors import PlanMismatchError, RematUsageError
from remat_dist.fsdp._budget_backward import (
    at_end_of_backward,
    input_shapes,
)
from remat_dist.fsdp._budget_config import BlockPlan, BudgetPlan, MemoryBudget
from remat_dist.fsdp._budget_profile import (
    DEFAULT_REGION_NAMES,
    Candidate,
    Counter,
    candidates,
    human,
    param_keys,
    parse_bytes,
    profile_block,
)
from remat_dist.fsdp._budget_solver import solve
from remat_dist.fsdp._patch import BLOCK_ATTR, REGION_ATTR, uninstall

__all__ = [
    "BUDGET_ATTR",
    "DEFAULT_REGION_NAMES",
    "BlockPlan",
    "BudgetPlan",
    "MemoryBudget",
    "attach_budget",
    "current_plan",
    "detach_budget",
    "parse_bytes",
]

log = get_logger(__name__)

BUDGET_ATTR = "_remat_dist_budget"
"""Instance attribute of a model under a :class:`MemoryBudget`: its planner state."""

# -- the state on the model -------------------------------------------------------


@dataclass
class _BudgetState:
    budget: MemoryBudget
    blocks: list[tuple[str, nn.Module]]
    candidates: list[list[Candidate]]
    install: Callable[[list[tuple[str, nn.Module, dict[str, str]]]], None]
    state_hooks: tuple[Any, ...] | None
    collectives: str
    side_passes: Callable[[], Any] | None = None  # a model adapter's context
    phase: str = "profile"  # profile | profiling | pending | verify | planned | failed
    counter: Counter | None = None
    params: set[Any] = field(default_factory=set)
    table: list[dict[str, tuple[int, float]]] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)  # per block, in the profiling forward
    plan: BudgetPlan | None = None
    install_next: bool = False  # "pending" with no backward to wait for
    error: Exception | None = None  # "failed": raised again by every later forward
    handles: list[Any] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # profiling inputs
    # the profiling forward's block records (alive while its graph is) and whether
    # a backward through a forward since has started: both empty/False means that
    # forward was dropped without backward, and the next one profiles again
    profile_graph: weakref.WeakSet[Any] | None = None
    backward_seen: bool = False
    replays_at_profile: int = 0  # the blocks' replay count when it was planned


def attach_budget(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    budget: MemoryBudget,
    *,
    install: Callable[[list[tuple[str, nn.Module, dict[str, str]]]], None],
    state_hooks: tuple[Any, ...] | None,
    collectives: str,
    side_passes: Callable[[], Any] | None = None,
) -> Callable[[], None]:
    """Check the budget's regions against ``blocks`` (raising before anything
    changes) and return the call that attaches the planner, once ``apply_remat``
    has checkpointed every block with full recompute. ``install(plans)`` rebuilds
    checkpoints (``(name, block, regions)`` each) as ``apply_remat`` does;
    ``side_passes()`` (a model adapter's) is the context the profiling side passes
    run in."""
    if BUDGET_ATTR in model.__dict__:
        raise RematUsageError(
            "remat_dist.apply_remat: the model already has a MemoryBudget. Fix: call "
            "remat_dist.fsdp.remove_remat(model) first."
        )
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
    state = _BudgetState(
        budget, list(blocks), cands, install, state_hooks, collectives, side_passes
    )

    def attach() -> None:
        model.__dict__[BUDGET_ATTR] = state
        state.handles = [
            model.register_forward_pre_hook(_pre_hook, prepend=True),
            model.register_forward_hook(_post_hook, always_call=True),
        ]
        for index, (_, module) in enumerate(blocks):
            spec = module.__dict__[BLOCK_ATTR]
            spec.run = _profiled(state, index, spec.run)

    return attach


def detach_budget(model: nn.Module) -> None:
    """Forget the planner (``remove_remat``); the checkpoints are removed apart."""
    state = model.__dict__.pop(BUDGET_ATTR, None)
    if state is not None:
        state.phase = "removed"  # a plan pending at the end of a backward: dropped
        for h in state.handles:
            h.remove()


def current_plan(model: nn.Module) -> BudgetPlan | None:
    """The plan a :class:`MemoryBudget` chose for ``model`` and runs: per block the
    decision, its bytes and its recompute time (maxima over ranks). None until the
    plan is installed (at the end of the profiling step's backward). Raises
    :class:`RematUsageError` when ``model`` has no memory budget."""
    state = model.__dict__.get(BUDGET_ATTR)
    if state is None:
        raise RematUsageError(
            f"remat_dist.current_plan: {type(model).__name__} has no MemoryBudget. "
            "Fix: apply_remat(model, blocks=..., policy=MemoryBudget(bytes=...))."
        )
    return state.plan if state.phase in ("verify", "planned") else None


# -- hooks ------------------------------------------------------------------------


def _pre_hook(model: nn.Module, args: Any) -> None:
    state: _BudgetState = model.__dict__[BUDGET_ATTR]
    if not torch.is_grad_enabled():
        return
    if state.phase == "failed":
        assert state.error is not None
        raise type(state.error)(str(state.error))
    if (
        state.phase == "pending"
        and not state.install_next
        and not state.backward_seen
        and not state.profile_graph
    ):
        if _replays(state) > state.replays_at_profile:
            # a backward replayed the blocks without going through the output (a
            # loss taken from an intermediate): it has ended, install now
            _install_plan(state)
        else:
            log.info(
                "MemoryBudget: the profiling forward was dropped without a backward "
                "(a sanity forward with grad enabled?); this forward profiles again"
            )
            state.phase, state.plan = "profile", None
    if state.phase == "pending" and state.install_next:
        _install_plan(state)  # the profiling forward's output had no grad to wait for
    # "pending": no backward through the profiling step has ended yet (more
    # micro-batches of that step): they run full recompute, like its first forward.
    if state.phase in ("profile", "verify"):
        if state.phase == "profile":
            state.phase = "profiling"
            state.shapes = input_shapes(args)
            state.table = [{} for _ in state.blocks]
            state.calls = [0 for _ in state.blocks]
        state.params = param_keys(model)
        state.counter = Counter(state.params, chain=True)
        state.counter.__enter__()


def _post_hook(model: nn.Module, args: Any, output: Any) -> None:
    state: _BudgetState = model.__dict__[BUDGET_ATTR]
    counter, state.counter = state.counter, None
    if state.phase == "pending" and torch.is_grad_enabled():
        # the plan waits for a backward to end; this forward's backward may be the
        # first (the profiling forward's output was kept without one)
        at_end_of_backward(
            output, functools.partial(_install_plan, state), _backward_seen(state)
        )
    if counter is None:
        return
    counter.__exit__(None, None, None)
    if state.phase == "verify":
        state.phase = "planned"
        assert state.plan is not None
        state.plan.measured_bytes = counter.total
        if counter.total > state.budget.bytes:
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
                human(counter.total), human(state.budget.bytes),
                human(state.plan.predicted_bytes), cause,
            )
        return
    if state.phase != "profiling":
        return
    # an always-called hook: after a forward that raised, from inside its handler
    if output is None and sys.exc_info()[0] is not None:
        state.phase = "profile"  # profile the next step instead
        return
    unused = [name for (name, _), n in zip(state.blocks, state.calls) if n == 0]
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
        state.phase, state.error = "failed", e  # later forwards raise it again
        raise
    except RematUsageError as e:
        _fail(state, output, e)
        return
    state.phase = "pending"
    state.backward_seen = False
    state.replays_at_profile = _replays(state)
    state.profile_graph = weakref.WeakSet(
        r for _, m in state.blocks for r in m.__dict__[BLOCK_ATTR].pending
    )
    if not at_end_of_backward(
        output, functools.partial(_install_plan, state), _backward_seen(state)
    ):
        # no tensor of the output requires grad: a backward, if any, goes through
        # something else (a loss kept on the model); before the next forward
        state.install_next = True


def _replays(state: _BudgetState) -> int:
    """Replays run so far by the blocks' checkpoints."""
    return sum(m.__dict__[BLOCK_ATTR].replays for _, m in state.blocks if BLOCK_ATTR in m.__dict__)


def _backward_seen(state: _BudgetState) -> Callable[[], None]:
    def seen() -> None:
        state.backward_seen = True

    return seen


def _fail(state: _BudgetState, output: Any, error: Exception) -> None:
    """The planner cannot go on: raise ``error`` at the end of the profiling step's
    backward (its gradients are complete), or now when no backward will come; every
    later grad-enabled forward raises it again (``_pre_hook``)."""
    state.phase = "failed"
    state.error = error

    def fail() -> None:
        raise type(error)(str(error))

    if not at_end_of_backward(output, fail):
        fail()


# -- profiling --------------------------------------------------------------------


def _profiled(state: _BudgetState, index: int, run: Any) -> Any:
    def profiled_run(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if state.phase == "profiling" and torch.is_grad_enabled():
            with state.side_passes() if state.side_passes else contextlib.nullcontext():
                row = profile_block(
                    state.blocks[index][0], module, state.candidates[index], args,
                    kwargs, params=state.params, state_hooks=state.state_hooks,
                    collectives=state.collectives, repeats=state.budget.repeats,
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


def _plan(state: _BudgetState, outside: int) -> None:
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
    for b, ((name, _), cands) in enumerate(zip(state.blocks, state.candidates)):
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


def _install_plan(state: _BudgetState) -> None:
    """Rebuild the blocks' checkpoints as the plan says; the next grad-enabled
    forward is counted once more (``BudgetPlan.measured_bytes``)."""
    plan = state.plan
    assert plan is not None
    if state.phase != "pending":
        return
    state.phase = "verify"
    plans = []
    for (name, module), bp in zip(state.blocks, plan.blocks):
        for _, sub in module.named_modules():
            if REGION_ATTR in sub.__dict__ or BLOCK_ATTR in sub.__dict__:
                uninstall(sub)
        if bp.regions is not None:
            plans.append((name, module, dict(bp.regions)))
    state.install(plans)
