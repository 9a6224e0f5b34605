"""``MemoryBudget`` on 2 real gloo ranks with FSDP2, rank 1 with twice the batch of
rank 0: the reference GPT with 6 blocks and dropout, three budgets between full
recompute and no checkpointing (of the rank that needs most).

Per budget: every rank's saved bytes after forward (``SavedBytesCounter`` around
``model(tokens)``) are within the budget in every step; both ranks hold the same
plan, and the per-step plan agreement passes (a mismatch would raise in backward);
each rank's gradient shards are bitwise those of no checkpointing, the profiling
step's included; a larger budget never gives a slower plan (priced on the same
measurements, see ``check_larger_budget_not_slower``). At the middle budget a
one-sample sanity forward, dropped without backward, comes first: both ranks
profile the training batch again and agree.
"""

from __future__ import annotations

import pytest
import torch.nn.functional as F

import remat_dist as remat
from remat_dist import RematUsageError, apply_remat, shard_model
from remat_dist.budget import current_plan
from remat_dist.models import GPT, Block, make_batch
from remat_dist.shard import reference_tp_plan
from remat_dist.testing import DistContext, distributed
from tests.budget.test_budget import (
    CFG,
    check_larger_budget_not_slower,
    grads_equal,
    run_steps,
)


def _model(mesh, policy=None):
    model = GPT(CFG)
    if policy is not None:
        apply_remat(model, blocks=Block, policy=policy)
    shard_model(model, mesh, blocks=Block)
    return model


def _batch(rank: int):
    return make_batch(CFG, 2 * (rank + 1), seed=10 + rank)  # rank 1: twice the batch


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("dp",), timeout=120)
def test_three_budgets_two_ranks_unequal_batches(ctx: DistContext):
    batch = _batch(ctx.rank)
    ref = run_steps(_model(ctx.mesh), batch, seed=ctx.rank)
    full = run_steps(_model(ctx.mesh, "full"), batch, steps=1, seed=ctx.rank)[0][0]
    fulls = ctx.all_gather_object(full)
    nones = ctx.all_gather_object(ref[0][0])
    assert fulls[1] > fulls[0] and nones[1] > nones[0]  # rank 1 needs more
    lo, hi = max(fulls), max(nones)
    plans = []
    for frac in (0.25, 0.5, 0.75):
        budget = int(lo + frac * (hi - lo))
        model = _model(ctx.mesh, remat.MemoryBudget(bytes=budget))
        if frac == 0.5:  # a sanity forward dropped without backward: profiled again
            model(batch[0][:1])
        runs = run_steps(model, batch, seed=ctx.rank)
        plan = current_plan(model)
        assert plan.world_size == 2
        for step, ((saved, grads), (_, ref_grads)) in enumerate(zip(runs, ref)):
            assert saved <= budget, (ctx.rank, frac, step, saved, budget)
            assert grads_equal(grads, ref_grads), (ctx.rank, frac, step)
        assert plan.measured_bytes == runs[1][0] <= plan.predicted_bytes
        decisions = ctx.all_gather_object(plan.decisions())
        assert decisions[0] == decisions[1]
        assert set(decisions[0].values()) != {"full"}
        # the per-block numbers are the maxima over ranks: rank 1's here (twice the
        # batch). Its full-recompute total, as the plan's numbers give it, is what
        # rank 1 saved in the profiling step, on rank 0 too
        tables = ctx.all_gather_object([b.candidates for b in plan.blocks])
        assert tables[0] == tables[1]
        assert ctx.all_gather_object(runs[0][0]) == fulls  # profiling: full recompute
        planned_full = plan.outside_bytes + sum(b.candidates["full"][0] for b in plan.blocks)
        assert planned_full == fulls[1] > fulls[0], (ctx.rank, planned_full, fulls)
        plans.append(plan)
    check_larger_budget_not_slower(plans)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("dp",), timeout=120)
def test_infeasible_on_the_larger_rank_raises_on_both(ctx: DistContext):
    batch = _batch(ctx.rank)
    fulls = ctx.all_gather_object(
        run_steps(_model(ctx.mesh, "full"), batch, steps=1, seed=ctx.rank)[0][0]
    )
    # enough for rank 0, not for rank 1
    budget = (fulls[0] + fulls[1]) // 2
    model = _model(ctx.mesh, remat.MemoryBudget(bytes=budget))
    tokens, targets = batch
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    with pytest.raises(RematUsageError, match=r"rank 1 needs most") as ei:
        loss.backward()
    msg = str(ei.value)
    smallest = int(msg.split("smallest feasible budget is ")[1].split()[0].replace(",", ""))
    # the model's forward at full recompute and what the cross-entropy saves
    assert smallest > fulls[1] and "saved after the forward, by the loss" in msg, msg


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",), timeout=120)
def test_tensor_parallel_budget(ctx: DistContext):
    """Under TP the side passes of the profiling step issue the blocks' collectives
    (inside their checkpoints and in the timed forwards) on both ranks alike; the
    step agreements pass and the replayed gradients stay bitwise."""

    def build(policy):
        model = GPT(CFG)
        if policy is not None:
            apply_remat(model, blocks=Block, policy=policy)
        shard_model(model, ctx.mesh, blocks=Block, tp_plan=reference_tp_plan())
        return model

    batch = make_batch(CFG, 2, seed=3)  # one batch: TP ranks see the same data
    ref = run_steps(build(None), batch)
    full = run_steps(build("full"), batch, steps=1)[0][0]
    budget = (full + ref[0][0]) // 2
    model = build(remat.MemoryBudget(bytes=budget))
    runs = run_steps(model, batch)
    for (saved, grads), (_, ref_grads) in zip(runs, ref):
        assert saved <= budget
        assert grads_equal(grads, ref_grads)
    decisions = ctx.all_gather_object(current_plan(model).decisions())
    assert decisions[0] == decisions[1] and set(decisions[0].values()) != {"full"}


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("dp",), timeout=120)
def test_profiling_step_issues_collectives_without_python_hooks(ctx: DistContext, monkeypatch):
    # The profiling step counts saved bytes with Python saved-tensor hooks on the
    # stack while FSDP2 all-gathers; a collective issued under them must go through
    # the interception kernel, which issues it with the hooks taken off (a backend
    # work holding a Python hook aborts the process at interpreter exit).
    import torch
    import torch.distributed as dist

    from remat_dist._torch import _autograd
    from remat_dist.distributed import _intercept

    seen: list[bool] = []
    bare = _intercept._issue_bare

    def recording(redispatch, keyset, args):
        seen.append(_autograd.top_saved_tensors_hooks(True) is not None)
        return bare(redispatch, keyset, args)

    monkeypatch.setattr(_intercept, "_issue_bare", recording)
    model = _model(ctx.mesh, remat.MemoryBudget(bytes="1MiB"))
    hooked: list[bool] = []

    def probe(module, args):  # a collective of the model's own, under the hooks
        if not remat.is_recomputing():
            hooked.append(_autograd.top_saved_tensors_hooks(True) is not None)
            before = len(seen)
            dist.all_reduce(torch.ones(2))
            assert seen[before:] == [True], seen[before:]

    model.layers[0].register_forward_pre_hook(probe)
    tokens, targets = _batch(ctx.rank)
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    assert hooked and hooked[0]  # the profiling step ran its forward under hooks
