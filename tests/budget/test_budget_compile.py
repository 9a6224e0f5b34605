"""``MemoryBudget(compile=...)``: the profiling step runs eagerly and prices
every candidate compiled, then each block is compiled once with its plan.

``backend="aot_eager"`` runs the same ATen kernels as eager through
AOTAutograd's graphs, so the losses and gradients are compared bitwise with
the same model compiled without remat (inductor's fused kernels would differ
from one graph to another in the last bits)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import remat_dist as remat
from remat_dist.models import GPT, Block, GPTConfig, make_batch
from remat_dist.testing import PeakSavedBytes

CONFIG = GPTConfig(vocab_size=512, seq_len=16, dim=32, n_heads=4, n_layers=4)
OPTIONS = {"backend": "aot_eager", "fullgraph": True}


def _cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train(policy, steps: int = 4, options=OPTIONS, loss_fn=_cross_entropy):
    """Plain steps: per step the peak of every byte saved (the loss
    included), the loss, the gradients, and the graphs Dynamo had made."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if policy is None:
        for block in model.layers:
            block.compile(**options)
    else:
        remat.apply_remat(model, blocks=Block, policy=policy)
    meter = PeakSavedBytes(model, whole_step=True)
    out = []
    for step in range(steps):
        tokens, targets = make_batch(CONFIG, 4, seed=step)
        meter.reset()
        with meter:
            loss = loss_fn(model(tokens), targets)
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out.append((meter.peak, loss.detach(), grads, counters["stats"]["unique_graphs"]))
        model.loss_part = meter.peak - meter.forward_peak
        model.zero_grad(set_to_none=True)
    return out, model


def _assert_within_budget_and_bitwise(runs, ref, budget):
    """Every step's peak at or under ``budget``; losses and gradients bitwise
    those of ``ref``."""
    for step, (peak, _, _, _) in enumerate(runs):
        assert peak <= budget, (step, peak, budget)
    for (_, loss, grads, _), (_, ref_loss, ref_grads, _) in zip(runs, ref):
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)


@pytest.mark.slow  # compiles the blocks and the pricing graphs
def test_compiled_budget_is_bitwise_within_budget_and_compiles_once():
    """Half-way between the compiled model's whole-step peak without remat and
    eager full recompute's: every step's peak of all saved bytes, the loss
    included, at or under the budget, the compiled steps' too (the plan prices
    what the compiled blocks save, not the eager candidates); the first
    compiled forward saves what the plan predicted, to the byte; losses and
    gradients bitwise those of the model compiled without remat; the profiling
    step compiles one pricing graph per candidate (the 4 blocks share one
    signature), the blocks compile once after it, and no step recompiles."""
    ref, _ = _train(None)
    lo = _train("full", steps=1)[0][0][0]
    budget = (lo + ref[1][0]) // 2
    runs, model = _train(remat.MemoryBudget(bytes=budget, compile=OPTIONS))
    plan = remat.budget.current_plan(model)
    assert plan is not None and set(plan.decisions().values()) != {"full"}
    assert plan.measured_bytes == plan.predicted_bytes - plan.loss_bytes
    _assert_within_budget_and_bitwise(runs, ref, budget)
    graphs = [g for _, _, _, g in runs]
    candidates = len(plan.blocks[0].candidates)
    assert not any(c.startswith("min-cut") for c in plan.blocks[0].candidates)  # not inductor
    assert graphs[0] == candidates  # the pricing graphs, one per candidate
    assert graphs[1] > graphs[0]  # then the blocks, compiled with the plan
    assert graphs[1] == graphs[2] == graphs[3]  # no recompile per step


@pytest.mark.slow  # inductor compiles every candidate of the block once
def test_inductor_budget_prices_min_cut_per_block_and_holds():
    """With inductor each block may also be compiled without a checkpoint at
    an ``activation_memory_budget`` of 0.1 / 0.2 / 0.3 / 0.5 / 0.75 (torch's min-cut
    chooses the ops it recomputes within the block); the profiling step
    prices those too, compiled. Half-way between full recompute's whole-step
    peak and no checkpoint's: every step's peak of all saved bytes at or under
    the budget, the first compiled forward saving what the plan priced, no
    recompile per step; losses and gradients equal those of the blocks
    compiled without remat to float32 rounding (inductor fuses the kernels of
    graphs with and without recompute differently: rtol 1e-4, atol 1e-6)."""
    options = {"fullgraph": True}
    ref, _ = _train(None, options=options)
    lo = _train("full", steps=1)[0][0][0]
    budget = (lo + ref[1][0]) // 2
    runs, model = _train(remat.MemoryBudget(bytes=budget, compile=options), options=options)
    plan = remat.budget.current_plan(model)
    assert plan is not None
    for block in plan.blocks:
        labels = set(block.candidates)
        assert {"min-cut 0.1", "min-cut 0.2", "min-cut 0.3", "min-cut 0.5",
                "min-cut 0.75"} <= labels, labels
        assert (block.memory_budget is None) == (not block.decision.startswith("min-cut"))
    assert plan.measured_bytes == plan.predicted_bytes - plan.loss_bytes
    for step, (peak, _, _, _) in enumerate(runs):
        assert peak <= budget, (step, peak, budget)
    for (_, loss, grads, _), (_, ref_loss, ref_grads, _) in zip(runs, ref):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-6)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6)
    graphs = [g for _, _, _, g in runs]
    assert graphs[1] == graphs[2] == graphs[3]


@pytest.mark.slow  # compiles the blocks, the pricing graphs and the loss
def test_a_compiled_loss_outside_the_model_is_inside_the_compiled_budget():
    """A loss compiled apart from the model (as torchtitan compiles its loss;
    the way to run a language model's loss fused when the budget compiles the
    blocks): the profiling step sees what the compiled loss saves, the plan
    counts it, and every step's peak of all saved bytes, that loss included,
    stays at or under the budget; the loss's share of the last step equals the
    plan's ``loss_bytes``; losses and gradients bitwise those of the blocks
    compiled without remat with the same compiled loss; no recompile per step."""
    loss_fn = torch.compile(_cross_entropy, **OPTIONS)
    ref, _ = _train(None, loss_fn=loss_fn)
    lo = _train("full", steps=1, loss_fn=loss_fn)[0][0][0]
    budget = (lo + ref[1][0]) // 2
    runs, model = _train(remat.MemoryBudget(bytes=budget, compile=OPTIONS), loss_fn=loss_fn)
    plan = remat.budget.current_plan(model)
    assert plan is not None and set(plan.decisions().values()) != {"full"}
    assert plan.loss_bytes > 0 and model.loss_part == plan.loss_bytes
    _assert_within_budget_and_bitwise(runs, ref, budget)
    graphs = [g for _, _, _, g in runs]
    assert graphs[1] == graphs[2] == graphs[3]


def test_compile_option_is_checked():
    """``compile=`` takes True, False or a mapping of torch.compile options."""
    assert remat.MemoryBudget(bytes=1, compile=True).compile == ()
    assert remat.MemoryBudget(bytes=1, compile={"fullgraph": True}).compile == (
        ("fullgraph", True),)
    with pytest.raises(remat.RematUsageError, match="torch.compile options"):
        remat.MemoryBudget(bytes=1, compile="inductor")
