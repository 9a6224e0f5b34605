"""shard_model: what it refuses, the sequence-parallel pitfall it guards against, a
root plan, order errors, and the equivalence helper under FSDP2 (2 gloo ranks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from remat_dist import RematUsageError, apply_remat, shard_model
from remat_dist._torch import TORCH_RELEASE
from remat_dist.models import (
    GPT,
    MLP,
    Attention,
    Block,
    block_tp_plan,
    make_batch,
)
from remat_dist.shard import TensorParallelPlan, reference_tp_plan
from remat_dist.testing import dist_context, run_distributed
from remat_dist.testing.equivalence import assert_remat_equivalent
from remat_dist.wrap import checkpointed_blocks
from tests.shard.test_matrix import CFG, TP_TOL, assert_same, full_result, train
from tests.wrap._rng import cpu_hooks

CFG0 = dataclasses.replace(CFG, dropout=0.0)


def _raises(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(RematUsageError, match=match) as info:
        fn(*args, **kwargs)
    return str(info.value)


def tp_body() -> dict[str, float]:
    mesh = dist_context().mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    sp = reference_tp_plan(sequence_parallel=True)
    # A bare sequence-parallel dict says nothing about block inputs: refused.
    _raises(
        "shards the sequence dimension",
        shard_model,
        GPT(CFG0),
        mesh,
        blocks=Block,
        tp_plan=dict(sp.block),
    )
    # Sequence layouts in the root plan would see full tensors: refused.
    _raises(
        "tp_plan.root shards the sequence",
        shard_model,
        GPT(CFG0),
        mesh,
        blocks=Block,
        tp_plan=TensorParallelPlan(
            block=block_tp_plan(), root={"norm": SequenceParallel()}
        ),
    )
    # A key that resolves nowhere (parallelize_module would only warn): refused.
    _raises(
        "'attention.wz' names no submodule",
        shard_model,
        GPT(CFG0),
        mesh,
        blocks=Block,
        tp_plan={"attention.wz": ColwiseParallel()},
    )
    # A mesh named tp without a plan, a root key inside a block: refused.
    _raises("named 'tp' but no tp_plan", shard_model, GPT(CFG0), mesh, blocks=Block)
    _raises(
        "inside block",
        shard_model,
        GPT(CFG0),
        mesh,
        blocks=Block,
        tp_plan=TensorParallelPlan(
            block=block_tp_plan(), root={"layers.0.mlp.w1": ColwiseParallel()}
        ),
    )
    # A sequence not divisible by the TP degree: refused at the block input.
    model = shard_model(GPT(CFG0), mesh, blocks=Block, tp_plan=sp)
    tokens, targets = make_batch(CFG0, 2, seed=0)
    _raises("not divisible", model.loss, tokens[:, :15], targets[:, :15])

    batch = make_batch(CFG0, 2, seed=0)
    ref = train(CFG0, batch).result
    # The pitfall: claim the SP blocks take full tensors, and the full sequence is
    # silently taken as a shard -- wrong gradients, no error.
    lying = TensorParallelPlan(
        block=sp.block, block_input="replicate", block_output="replicate"
    )
    wrong = full_result(train(CFG0, batch, mesh=mesh, tp_plan=lying))
    grad_err = max(
        float((wrong.grads[n] - g).abs().max()) for n, g in ref.grads.items()
    )
    assert grad_err > 1e-2
    # A root plan (column-parallel head, gathered logits) stays exact to TP_TOL,
    # and remat on top of it is bitwise.
    head = TensorParallelPlan(
        block=block_tp_plan(),
        root={"lm_head": ColwiseParallel(output_layouts=Replicate())},
    )
    plain = train(CFG, batch, mesh=mesh, tp_plan=head)
    remat = train(CFG, batch, mesh=mesh, tp_plan=head, policy={"attention": "save"})
    assert_same(plain.result, remat.result, "root plan remat")
    head_err = assert_same(
        train(CFG, batch).result, full_result(plain), "root plan", **TP_TOL
    )
    return {"pitfall_grad_err": grad_err, "root_plan_err": head_err}


def fsdp_body() -> None:
    mesh = dist_context().mesh
    from torch.distributed.tensor.parallel import ColwiseParallel

    # A checkpointed block that would contain FSDP units: refused in both orders.
    model = apply_remat(GPT(CFG), blocks=Block)
    _raises(
        "contains the FSDP unit 'layers.0.attention'",
        shard_model,
        model,
        mesh,
        blocks=(Attention, MLP),
    )
    model = shard_model(GPT(CFG), mesh, blocks=(Attention, MLP))
    _raises(
        "contains the FSDP unit 'layers.0.attention'", apply_remat, model, blocks=Block
    )
    assert checkpointed_blocks(model) == {}
    # Sharding twice; a 1-D 'dp' mesh with a TP plan; remat twice after sharding.
    model = shard_model(GPT(CFG), mesh, blocks=Block)
    _raises("already an FSDP module", shard_model, model, mesh, blocks=Block)
    _raises(
        "1-D mesh named 'dp'",
        shard_model,
        GPT(CFG),
        mesh,
        blocks=Block,
        tp_plan={"attention.wq": ColwiseParallel()},
    )
    apply_remat(model, blocks=Block, recompute_state_hooks=cpu_hooks())
    _raises(
        "block 'layers.0' is already checkpointed", apply_remat, model, blocks=Block
    )
    # The user-facing helper under FSDP2, remat applied after sharding.
    report = assert_remat_equivalent(
        lambda: GPT(CFG),
        make_batch(CFG, 2, seed=torch.distributed.get_rank()),
        blocks=Block,
        policy={"attention": "save"},
        steps=3,
        loss_fn=lambda m, b: m.loss(*b),
        recompute_state_hooks=cpu_hooks(),
        shard=lambda m: shard_model(m, mesh, blocks=Block, reshard_after_forward=False),
        remat_first=False,
    )
    assert report.checkpointed == ["layers.0", "layers.1"]


def test_tp_refusals_pitfall_and_root_plan():
    results = run_distributed(
        tp_body, world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",), timeout=120
    )
    print(f"\n[shard_model TP] {results[0]}")


def sequence_dtensor_body() -> str:
    """SequenceParallel left as DTensors, gathered implicitly by the next Linear."""
    mesh = dist_context().mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    block = {
        "ln1": SequenceParallel(use_local_output=False),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ln2": SequenceParallel(use_local_output=False),
        "mlp.w1": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    plan = TensorParallelPlan(
        block=block, block_input="sequence", block_output="sequence"
    )
    batch = make_batch(CFG0, 2, seed=0)
    if TORCH_RELEASE < (2, 12):
        msg = _raises("'ln1', 'ln2' are SequenceParallel", shard_model, GPT(CFG0), mesh,
                      blocks=Block, tp_plan=plan)
        assert "torch 2.12" in msg and "PrepareModuleInput(input_layouts=" in msg
        # gathered explicitly, the same layers run on this torch
        gather = PrepareModuleInput(input_layouts=(Shard(1),),
                                    desired_input_layouts=(Replicate(),))
        block = {**block, "attention": gather, "mlp": gather}
        plan = dataclasses.replace(plan, block=block)
    ref = train(CFG0, batch).result
    err = assert_same(ref, full_result(train(CFG0, batch, mesh=mesh, tp_plan=plan)),
                      "SequenceParallel DTensor outputs", **TP_TOL)
    return f"max error {err:.1e}"


def test_sequence_parallel_dtensor_outputs_or_the_release_that_runs_them():
    results = run_distributed(
        sequence_dtensor_body, world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",),
        timeout=120,
    )
    print(f"\n[SequenceParallel DTensor outputs] {results[0]}")


def test_fsdp_order_errors_and_helper():
    run_distributed(
        fsdp_body, world_size=2, mesh_shape=(2,), mesh_dim_names=("dp",), timeout=120
    )
