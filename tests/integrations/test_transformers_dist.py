"""transformers models under FSDP2 (and transformers' own tensor-parallel plan) on 2
real gloo ranks, with remat_dist finding the blocks and turning the cache off.

FSDP2, rank 1 with a larger batch than rank 0, SDPA attention (eager for Gemma2,
which has no SDPA path) and the default
config (``use_cache=True``, the case that failed in the first backward with a
``MemoryBudget``): four architecture families x {full, attention kept,
``MemoryBudget``} give each rank's gradient shards bitwise those of FSDP2 without
checkpointing, in every step. Mixtral's router token counts and load-balancing
loss are those of the run without checkpointing.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import remat_dist as remat  # noqa: E402
from remat_dist.integrations.transformers import keep_attention, layout  # noqa: E402
from remat_dist.testing import DistContext, distributed  # noqa: E402
from tests.integrations._hf import batch, build, same, step  # noqa: E402

DIST_FAMILIES = ("llama", "qwen2", "mixtral", "gemma2")


def _model(ctx: DistContext, family: str, policy=None):
    attn = "eager" if family == "gemma2" else "sdpa"  # Gemma2 has no SDPA path
    extra = {"output_router_logits": True} if family == "mixtral" else {}
    model = build(family, attn=attn, **extra)
    if policy is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the use_cache notice
            remat.apply_remat(model, policy=policy(model) if callable(policy) else policy)
    remat.shard_model(model, ctx.mesh, blocks=layout(model).block_classes)
    return model


def _token_counts(out, experts: int = 4, top_k: int = 2) -> list[list[int]]:
    """Tokens routed to each expert, per layer, from the router logits returned."""
    return [
        torch.bincount(logits.topk(top_k, dim=-1).indices.flatten(), minlength=experts).tolist()
        for logits in out.router_logits
    ]


def _steps(model, ids, steps=2):
    return [step(model, ids, seed=100 + s) for s in range(steps)]


@pytest.mark.parametrize("family", DIST_FAMILIES)
@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("dp",), timeout=240)
def test_fsdp2_unequal_batches_bitwise_for_every_policy(ctx: DistContext, family):
    ids = batch(2 + ctx.rank, seed=10 + ctx.rank)  # rank 1: a larger batch
    ref = _steps(_model(ctx, family), ids)
    full = _steps(_model(ctx, family, "full"), ids)
    fulls = ctx.all_gather_object(full[0][0])
    nones = ctx.all_gather_object(ref[0][0])
    assert fulls[1] > fulls[0] and nones[1] > nones[0]  # rank 1 needs more
    budget = remat.MemoryBudget(bytes=(max(fulls) + max(nones)) // 2, repeats=1)
    runs = {
        "full": full,
        "attention kept": _steps(_model(ctx, family, keep_attention), ids),
        "budget": _steps(budget_model := _model(ctx, family, budget), ids),
    }
    for name, run in runs.items():
        for s, ((_, grads, out), (_, ref_grads, ref_out)) in enumerate(zip(run, ref)):
            assert torch.equal(out.loss, ref_out.loss), (name, s)
            assert not same(grads, ref_grads), (ctx.rank, name, s, same(grads, ref_grads))
            if family == "mixtral":  # the router saw the same tokens, once each
                assert len(out.router_logits) == 2
                assert _token_counts(out) == _token_counts(ref_out), (name, s)
                assert torch.equal(out.aux_loss, ref_out.aux_loss), (name, s)
    assert runs["full"][1][0] < runs["attention kept"][1][0] < ref[1][0]
    plan = remat.budget.current_plan(budget_model)
    assert plan is not None and runs["budget"][1][0] <= budget.bytes
    decisions = ctx.all_gather_object(plan.decisions())
    assert decisions[0] == decisions[1]


def _tp_model(ctx: DistContext, policy):
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    model = build("qwen2", attn="sdpa")
    plan = model._expand_parallel_plan(model.tp_plan)  # transformers' own plan
    apply_tensor_parallelism(model, ctx.mesh, plan)
    if policy is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            remat.apply_remat(model, policy=policy)
    return model, plan


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",), timeout=240)
def test_transformers_tensor_parallel_plan_on_cpu(ctx: DistContext):
    ids = batch(2, seed=7)  # TP ranks see the same batch
    ref_model, plan = _tp_model(ctx, None)
    assert any(v.startswith("colwise") for v in plan.values())
    ref = _steps(ref_model, ids)
    for policy in ("full", {"self_attn": "save"}):
        model, _ = _tp_model(ctx, policy)
        for (_, grads, out), (_, ref_grads, ref_out) in zip(_steps(model, ids), ref):
            assert torch.equal(out.loss, ref_out.loss)
            assert not same(grads, ref_grads), (policy, same(grads, ref_grads))
    # and the sharded model computes what the unsharded one does
    plain_loss = step(build("qwen2", attn="sdpa"), ids, seed=100)[2].loss
    torch.testing.assert_close(ref[0][2].loss, plain_loss)
    losses = [torch.zeros(()) for _ in range(ctx.world_size)]
    dist.all_gather(losses, ref[0][2].loss.detach().reshape(()))
    assert torch.equal(losses[0], losses[1])
