"""``MemoryBudget`` under ``torch.distributed.pipelining``: real gloo processes, 2
stages (and 2x2 with tensor parallelism or FSDP2), the stages of
``tests/distributed/test_pipeline.py`` (slices of the reference GPT, 2 blocks each,
4 micro-batches).

The budget is the rank's peak: the most bytes saved for backward alive at any
moment of a whole schedule step, every micro-batch in flight and the schedule's
``loss_fn`` included, measured here by ``PeakSavedBytes(whole_step=True)``
entered around each ``schedule.step`` (unique storages, parameters apart, as ``SavedBytesCounter``
counts them). Each stage plans at the
end of its profiling step from what it measured there (nothing gathered across
stages, so no deadlock with the pipeline's sends and receives), for the forwards
the schedule kept alive at once on it.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

import remat_dist as remat
from remat_dist._torch import TORCH_RELEASE
from remat_dist.budget._solver import brute_force, plan_cost
from remat_dist.models import GPT, Block, GPTStage, block_tp_plan, make_batch
from remat_dist.testing import DistContext, PeakSavedBytes, distributed
from tests.budget._joint_check import joint_bounds, joint_optimum

pytest.importorskip("torch.distributed.pipelining")

from tests.distributed.test_pipeline import (  # noqa: E402
    BATCH,
    CONFIG,
    MICRO_BATCHES,
    _loss_fn,
)

IN_FLIGHT = {"Schedule1F1B": (2, 1), "ScheduleGPipe": (4, 4)}
"""Forwards alive at once on stage 0 and stage 1 of 2, 4 micro-batches."""

pytest.importorskip(
    "numpy",
    reason="torch.distributed.pipelining exchanges stage metadata with "
    "recv_object_list, which needs numpy (torch's need, not remat_dist's)",
)


def _build(stage: int, policy, *, tp_mesh=None, dp_mesh=None):
    per = CONFIG.n_layers // 2
    torch.manual_seed(0)
    module = GPTStage(GPT(CONFIG), list(range(stage * per, (stage + 1) * per)),
                      first=stage == 0, last=stage == 1)
    if tp_mesh is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        for block in module.layers.values():
            parallelize_module(block, tp_mesh, block_tp_plan())
    if policy is not None:
        remat.apply_remat(module, blocks=Block, policy=policy)
    if dp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for block in module.layers.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(module, mesh=dp_mesh)
    return module


def _run(schedule_name, policy, *, pp_group, stage, steps=3, tp_mesh=None, dp_mesh=None,
         seed_rank=0, loss_fn=_loss_fn):
    """``steps`` schedule steps on this rank's stage: per step the peak of live
    activation bytes, the losses (last stage) and the gradients; the stage module."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as sch

    module = _build(stage, policy, tp_mesh=tp_mesh, dp_mesh=dp_mesh)
    meter = PeakSavedBytes(module, whole_step=True)
    pipe = PipelineStage(module, stage, 2, torch.device("cpu"), group=pp_group)
    schedule = getattr(sch, schedule_name)(pipe, n_microbatches=MICRO_BATCHES,
                                           loss_fn=loss_fn)
    out = []
    for step in range(steps):
        tokens, targets = make_batch(CONFIG, BATCH, seed=100 + 10 * step + seed_rank)
        module.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        losses: list = []
        meter.reset()
        with meter:
            if stage == 0:
                schedule.step(tokens)
            else:
                schedule.step(target=targets, losses=losses)
        grads = {n: getattr(p.grad, "_local_tensor", p.grad).clone()
                 for n, p in module.named_parameters()}
        out.append((meter.peak, [x.detach().clone() for x in losses], grads))
    return out, module


@contextlib.contextmanager
def _plan_logs():
    """The planner's info records while the block runs (as REMAT_DIST_LOG=info
    shows them)."""
    logger = logging.getLogger("remat_dist.budget._planner")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "MemoryBudget plan for" in record.getMessage():
                seen.append(record.getMessage())

    handler, level = Keep(level=logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _bitwise(runs, ref) -> None:
    for (_, losses, grads), (_, ref_losses, ref_grads) in zip(runs, ref):
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
        assert grads.keys() == ref_grads.keys()
        for k in grads:
            assert torch.equal(grads[k], ref_grads[k]), k


def _check_optimal(plan) -> None:
    """The chosen plan has the least time of every plan whose peak fits: brute
    force over all candidates' combinations, each weighted by the forwards in
    flight."""
    k = plan.in_flight
    costs = [[(k * w, t) for w, t in b.candidates.values()] for b in plan.blocks]
    cap = plan.budget - k * (plan.outside_bytes + plan.loss_bytes)
    best = brute_force(costs, cap)
    chosen = [list(b.candidates).index(b.decision) for b in plan.blocks]
    assert plan_cost(costs, chosen)[0] <= cap
    assert plan_cost(costs, chosen)[1] == plan_cost(costs, best)[1]


@pytest.mark.parametrize(
    "schedule_name", ["Schedule1F1B", "ScheduleGPipe"]
)
@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("pp",), timeout=180)
def test_budget_is_each_ranks_peak_per_stage(ctx: DistContext, schedule_name):
    """Three budgets between full recompute's peak and no checkpoint's (of the
    rank that needs most): no deadlock; every step's peak on every rank at or
    under the budget; losses and gradients bitwise those without remat; each
    stage plans for the forwards its schedule kept alive (1F1B: 2 on stage 0, 1
    on stage 1; GPipe: 4 on both); the plan is the brute-force optimum; in 1F1B
    stage 0 keeps fewer bytes per forward than stage 1 where the budget binds."""
    pp, stage = ctx.mesh.get_group(), ctx.rank
    ref, _ = _run(schedule_name, None, pp_group=pp, stage=stage, steps=2)
    full, _ = _run(schedule_name, "full", pp_group=pp, stage=stage, steps=1)
    lo = max(ctx.all_gather_object(full[0][0]))
    hi = max(ctx.all_gather_object(ref[0][0]))
    assert lo < hi
    kept = []
    for frac in (0.2, 0.5, 0.8):
        budget = int(lo + frac * (hi - lo))
        with _plan_logs() as logged:
            runs, module = _run(schedule_name, remat.MemoryBudget(bytes=budget),
                                pp_group=pp, stage=stage, steps=2)
        # REMAT_DIST_LOG=info: each stage's plan once, naming its blocks
        assert len(logged) == 1, logged
        assert f"blocks 'layers.{2 * stage}'..'layers.{2 * stage + 1}'" in logged[0]
        for step, (peak, _, _) in enumerate(runs):
            assert peak <= budget, (stage, frac, step, peak, budget)
        _bitwise(runs, ref)
        plan = remat.budget.current_plan(module)
        assert plan is not None and plan.world_size == 1 and plan.ranks == (stage,)
        assert plan.in_flight == IN_FLIGHT[schedule_name][stage]
        assert plan.predicted_peak_bytes <= budget
        _check_optimal(plan)
        kept.append(sum(b.bytes for b in plan.blocks))
    per_stage = ctx.all_gather_object(kept)
    if schedule_name == "Schedule1F1B":
        assert all(a <= b for a, b in zip(*per_stage)), per_stage
        assert any(a < b for a, b in zip(*per_stage)), per_stage


@pytest.mark.slow  # compiles each stage's pricing graphs and blocks
@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("pp",), timeout=300)
def test_compiled_budget_holds_on_every_rank(ctx: DistContext):
    """1F1B, 2 stages, ``MemoryBudget(compile=...)`` (``aot_eager``: eager's ATen
    kernels) half-way between full recompute's peak and no checkpoint's: every
    step's peak of every byte saved on every rank, the compiled steps', at or
    under the budget; the first compiled forward saves what the plan priced;
    losses and gradients bitwise those without remat."""
    pp, stage = ctx.mesh.get_group(), ctx.rank
    ref, _ = _run("Schedule1F1B", None, pp_group=pp, stage=stage, steps=3)
    full, _ = _run("Schedule1F1B", "full", pp_group=pp, stage=stage, steps=1)
    lo = max(ctx.all_gather_object(full[0][0]))
    hi = max(ctx.all_gather_object(ref[0][0]))
    budget = (lo + hi) // 2
    torch._dynamo.reset()
    policy = remat.MemoryBudget(bytes=budget,
                                compile={"backend": "aot_eager", "fullgraph": True})
    runs, module = _run("Schedule1F1B", policy, pp_group=pp, stage=stage, steps=3)
    plan = remat.budget.current_plan(module)
    assert plan is not None and set(plan.decisions().values()) != {"full"}
    assert plan.measured_bytes == plan.predicted_bytes - plan.loss_bytes
    peaks = ctx.all_gather_object([peak for peak, _, _ in runs])
    assert all(p <= budget for rank in peaks for p in rank), (peaks, budget)
    _bitwise(runs, ref)


def _mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A loss that saves nothing for backward."""
    return logits.float().mean()


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("pp",), timeout=120)
def test_budget_below_full_recompute_names_the_stage(ctx: DistContext):
    """1F1B with a loss that saves nothing: a budget that fits stage 1 at full
    recompute (1 forward in flight) but not stage 0 (2): stage 0 raises at the
    end of its profiling step, naming its blocks, its peak at full recompute
    and the budget; stage 1 trains on. (The last stage raises at the end of
    its last backward, before it sends its gradient: its peer would wait.)"""
    pp, stage = ctx.mesh.get_group(), ctx.rank
    full, _ = _run("Schedule1F1B", "full", pp_group=pp, stage=stage, steps=1,
                   loss_fn=_mean_loss)
    peaks = ctx.all_gather_object(full[0][0])
    budget = (peaks[0] + peaks[1]) // 2
    assert peaks[1] < budget < peaks[0]
    if stage == 0:
        with pytest.raises(Exception) as ei:  # torch's pipelining wraps it
            _run("Schedule1F1B", remat.MemoryBudget(bytes=budget), pp_group=pp,
                 stage=stage, steps=1, loss_fn=_mean_loss)
        err = ei.value
        while not isinstance(err, remat.RematUsageError) and err.__cause__ is not None:
            err = err.__cause__
        assert isinstance(err, remat.RematUsageError), ei.value
        msg = str(err)
        assert "blocks 'layers.0'..'layers.1'" in msg, msg
        assert f"a budget of {budget:,} bytes" in msg and "2 forward(s) alive" in msg
        smallest = int(msg.split("smallest feasible budget is ")[1].split()[0].replace(",", ""))
        assert smallest >= peaks[0]  # unique storages shared by micro-batches: at most
    else:
        runs, module = _run("Schedule1F1B", remat.MemoryBudget(bytes=budget),
                            pp_group=pp, stage=stage, steps=1, loss_fn=_mean_loss)
        assert runs[0][0] <= budget


def _interleaved(ctx: DistContext, policy, steps: int = 2):
    """ScheduleInterleaved1F1B, 2 ranks x 2 virtual stages (stages r and r + 2 on
    rank r, one block each), ``policy`` given to both stage modules of the rank
    (one object: one budget for the rank). Per step: the rank's peak (both
    modules' forwards counted together), the losses, the gradients."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as sch

    pp = ctx.mesh.get_group()
    mods, stages = [], []
    for k in range(2):
        s = ctx.rank + 2 * k
        torch.manual_seed(0)
        m = GPTStage(GPT(CONFIG), [s], first=s == 0, last=s == 3)
        if policy is not None:
            remat.apply_remat(m, blocks=Block, policy=policy)
        mods.append(m)
        stages.append(PipelineStage(m, s, 4, torch.device("cpu"), group=pp))
    meter = PeakSavedBytes(*mods, whole_step=True)  # the rank's peak
    schedule = sch.ScheduleInterleaved1F1B(stages, n_microbatches=MICRO_BATCHES,
                                           loss_fn=_loss_fn)
    out = []
    for step in range(steps):
        tokens, targets = make_batch(CONFIG, BATCH, seed=100 + step)
        for m in mods:
            m.zero_grad(set_to_none=True)
        meter.reset()
        losses: list = []
        with meter:
            if ctx.rank == 0:
                schedule.step(tokens)
            else:
                schedule.step(target=targets, losses=losses)
        grads = {f"{i}.{n}": p.grad.clone() for i, m in enumerate(mods)
                 for n, p in m.named_parameters()}
        out.append((meter.peak, losses, grads))
    return out, mods


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("pp",), timeout=180)
def test_interleaved_1f1b_one_budget_per_rank(ctx: DistContext):
    """ScheduleInterleaved1F1B, 2 ranks x 2 virtual stages, one MemoryBudget
    object per rank given to both of its stage modules: they plan jointly at the
    end of the later one's profiling step. At two budgets between the joint
    problem's smallest peak and its largest (the rank that needs most): no
    deadlock; the rank's peak over every step (both modules' forwards counted
    together) at or under the budget; losses and gradients bitwise those without
    remat; the joint plan is the brute-force optimum over every candidate of both
    modules' blocks; each module's plan says it shares the budget."""
    ref, _ = _interleaved(ctx, None)
    _, probe = _interleaved(ctx, remat.MemoryBudget(bytes="1GiB"), steps=1)
    plans = [remat.budget.current_plan(m) for m in probe]
    lo, hi = joint_bounds(plans)
    lo, hi = max(ctx.all_gather_object(lo)), max(ctx.all_gather_object(hi))
    assert lo < hi
    for frac in (0.3, 0.7):
        budget = int(lo + frac * (hi - lo))
        runs, mods = _interleaved(ctx, remat.MemoryBudget(bytes=budget))
        for step, (peak, _, _) in enumerate(runs):
            assert peak <= budget, (ctx.rank, frac, step, peak, budget)
        _bitwise(runs, ref)
        plans = [remat.budget.current_plan(m) for m in mods]
        assert all(p is not None and p.shared_by == 2 for p in plans)
        assert all(p.rank_peak_bytes <= min(budget, p.sum_bound_bytes) for p in plans)
        assert sum(p.predicted_time_s for p in plans) == joint_optimum(plans, budget)


def _v_shaped(ctx: DistContext, schedule_name: str, policy, steps: int = 2):
    """A V-shaped schedule, 2 ranks x 2 stage modules: rank r holds stages r
    and 3 - r (one block each), ``policy`` given to both (one object: one
    budget for the rank); stage 0 embeds, stage 3 (on rank 0) ends in the
    loss. Per step: the rank's peak of every byte saved, the losses, the
    gradients."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as sch

    pp = ctx.mesh.get_group()
    mods, stages = [], []
    for s in (ctx.rank, 3 - ctx.rank):
        torch.manual_seed(0)
        m = GPTStage(GPT(CONFIG), [s], first=s == 0, last=s == 3)
        if policy is not None:
            remat.apply_remat(m, blocks=Block, policy=policy)
        mods.append(m)
        stages.append(PipelineStage(m, s, 4, torch.device("cpu"), group=pp))
    meter = PeakSavedBytes(*mods, whole_step=True)
    schedule = getattr(sch, schedule_name)(stages, n_microbatches=MICRO_BATCHES,
                                           loss_fn=_loss_fn)
    out = []
    for step in range(steps):
        tokens, targets = make_batch(CONFIG, BATCH, seed=100 + step)
        for m in mods:
            m.zero_grad(set_to_none=True)
        meter.reset()
        losses: list = []
        with meter:
            if ctx.rank == 0:
                schedule.step(tokens, target=targets, losses=losses)
            else:
                schedule.step()
        grads = {f"{i}.{n}": p.grad.clone() for i, m in enumerate(mods)
                 for n, p in m.named_parameters()}
        out.append((meter.peak, losses, grads))
    return out, mods


@pytest.mark.skipif(
    TORCH_RELEASE < (2, 12),
    reason="the V-shaped schedules on 2 ranks need torch 2.12 (on 2.11 gloo fails: "
    "Pair is not connected)",
)
@pytest.mark.parametrize("schedule_name", ["ScheduleZBVZeroBubble", "ScheduleDualPipeV"])
@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("pp",), timeout=240)
def test_v_shaped_schedules_one_budget_per_rank(ctx: DistContext, schedule_name):
    """ZBVZeroBubble and DualPipeV (torch ships both), 2 ranks x 2 stage
    modules in a V, one MemoryBudget object per rank shared by its two modules,
    the schedule's loss_fn on rank 0: at two budgets between the rank's peak at
    full recompute and without checkpoints, every step's peak of every byte
    saved on every rank at or under the budget, losses and gradients bitwise
    those without remat, the plan the brute-force optimum at the moments the
    profiling step showed."""
    ref, _ = _v_shaped(ctx, schedule_name, None, steps=3)
    # a split backward's last weight half ends the step without a hook of the
    # budget's: the plan is made at the next step's first forward
    _, probe = _v_shaped(ctx, schedule_name, remat.MemoryBudget(bytes="1GiB"), steps=2)
    plans = [remat.budget.current_plan(m) for m in probe]
    lo, hi = joint_bounds(plans)
    lo, hi = max(ctx.all_gather_object(lo)), max(ctx.all_gather_object(hi))
    assert lo < hi
    for frac in (0.3, 0.7):
        budget = int(lo + frac * (hi - lo))
        runs, mods = _v_shaped(ctx, schedule_name, remat.MemoryBudget(bytes=budget), steps=3)
        for step, (peak, _, _) in enumerate(runs):
            assert peak <= budget, (ctx.rank, frac, step, peak, budget)
        _bitwise(runs, ref)
        plans = [remat.budget.current_plan(m) for m in mods]
        assert all(p is not None and p.shared_by == 2 for p in plans)
        assert all(p.rank_peak_bytes <= budget for p in plans)
        assert sum(p.predicted_time_s for p in plans) == joint_optimum(plans, budget)


def _mesh_run(mesh, schedule_name, policy, dim, steps=2):
    pp_mesh, other = mesh["pp"], mesh[dim]
    kw = {"tp_mesh": other} if dim == "tp" else {"dp_mesh": other}
    seed_rank = other.get_local_rank() if dim == "dp" else 0
    return _run(schedule_name, policy, pp_group=pp_mesh.get_group(),
                stage=pp_mesh.get_local_rank(), steps=steps, seed_rank=seed_rank, **kw)


def _plan_within_the_stage(ctx, dim):
    """2 stages x 2 (TP, or FSDP2 data parallel), 1F1B, a budget half-way: each
    stage's plan is gathered among its own two ranks only (its TP or DP group),
    both hold the same plan; peaks within the budget; bitwise those without
    remat."""
    import torch.distributed as dist

    mesh = ctx.mesh
    ref, _ = _mesh_run(mesh, "Schedule1F1B", None, dim)
    full, _ = _mesh_run(mesh, "Schedule1F1B", "full", dim, steps=1)
    lo = max(ctx.all_gather_object(full[0][0]))
    hi = max(ctx.all_gather_object(ref[0][0]))
    budget = (lo + hi) // 2
    runs, module = _mesh_run(mesh, "Schedule1F1B", remat.MemoryBudget(bytes=budget), dim)
    for peak, _, _ in runs:
        assert peak <= budget, (ctx.rank, peak, budget)
    _bitwise(runs, ref)
    plan = remat.budget.current_plan(module)
    mine = tuple(sorted(dist.get_process_group_ranks(mesh[dim].get_group())))
    assert plan.ranks == mine and plan.world_size == 2
    assert plan.in_flight == (2, 1)[mesh["pp"].get_local_rank()]
    plans = ctx.all_gather_object((mine, plan.decisions(), plan.in_flight))
    for ranks, decisions, in_flight in plans:
        if ranks == mine:
            assert decisions == plan.decisions() and in_flight == plan.in_flight


@pytest.mark.slow  # 4 ranks: the fast tier keeps the 2-rank cases
@distributed(world_size=4, mesh_shape=(2, 2), mesh_dim_names=("pp", "tp"), timeout=240)
def test_pp_x_tp_plans_within_the_stage(ctx: DistContext):
    _plan_within_the_stage(ctx, "tp")


@pytest.mark.slow  # 4 ranks: the fast tier keeps the 2-rank cases
@distributed(world_size=4, mesh_shape=(2, 2), mesh_dim_names=("pp", "dp"), timeout=240)
def test_pp_x_fsdp2_plans_within_the_stage(ctx: DistContext):
    _plan_within_the_stage(ctx, "dp")
