"""The memory budget counts the loss: what a plain loop's
``F.cross_entropy(model(x), y)`` saves (the log-softmax of the logits, over a
vocabulary much larger than the hidden size) is part of the rank's step, and
the peak of every byte saved over whole steps stays within the budget."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import remat_dist as remat
from remat_dist._torch._autograd import top_saved_tensors_hooks
from remat_dist.budget._after import close_window
from remat_dist.models import GPT, Block, GPTConfig, make_batch
from remat_dist.testing import PeakSavedBytes, SavedBytesCounter

CONFIG = GPTConfig(vocab_size=512, seq_len=16, dim=32, n_heads=4, n_layers=4)
BATCH = 4


def _train(policy, steps: int = 3):
    """``steps`` plain steps: per step the peak of every byte saved (loss
    included), the loss and the gradients; the model."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if policy is not None:
        remat.apply_remat(model, blocks=Block, policy=policy)
    meter = PeakSavedBytes(model, whole_step=True)
    out = []
    for step in range(steps):
        tokens, targets = make_batch(CONFIG, BATCH, seed=step)
        meter.reset()
        with meter:
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out.append((meter.peak, loss.detach(), grads))
        model.zero_grad(set_to_none=True)
    return out, model


def test_plain_loop_budget_counts_the_cross_entropy():
    """Three budgets between full recompute's whole-step peak and no
    checkpoint's: every step's peak of all saved bytes (the cross-entropy's
    log-softmax included) at or under the budget; losses and gradients bitwise
    those without remat; the plan names the loss's bytes (at least the fp32
    log-softmax of the logits) and predicts the peak it keeps."""
    ref, _ = _train(None)
    lo = _train("full", steps=1)[0][0][0]
    hi = ref[0][0]
    log_softmax = BATCH * CONFIG.seq_len * CONFIG.vocab_size * 4
    for frac in (0.25, 0.5, 0.8):
        budget = int(lo + frac * (hi - lo))
        runs, model = _train(remat.MemoryBudget(bytes=budget))
        for step, (peak, _, _) in enumerate(runs):
            assert peak <= budget, (frac, step, peak, budget)
        for (_, loss, grads), (_, ref_loss, ref_grads) in zip(runs, ref):
            assert torch.equal(loss, ref_loss)
            assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
        plan = remat.budget.current_plan(model)
        assert plan.loss_bytes >= log_softmax
        assert plan.predicted_peak_bytes <= budget
        assert max(p for p, _, _ in runs[1:]) == plan.predicted_peak_bytes


def test_loss_window_leaves_the_callers_hooks_as_they_were():
    """A counter entered around the forward only and left before the loss (the
    docs' example), and one around forward, loss and backward: each counts
    what it counted without a budget, and the saved-tensor hooks stack is empty
    once the next forward of the model has closed the last loss's window."""
    tokens, targets = make_batch(CONFIG, BATCH, seed=0)
    close_window()  # the last window of an earlier test in this process
    before = top_saved_tensors_hooks(False)
    counted = []
    for policy in (None, remat.MemoryBudget(bytes="1GiB")):
        torch.manual_seed(0)
        model = GPT(CONFIG)
        remat.apply_remat(model, blocks=Block, policy=policy or "full")
        row = []
        for _ in range(2):
            with SavedBytesCounter(model.parameters()) as forward_only:
                logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            with SavedBytesCounter(model.parameters()) as whole:
                F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
            row.append((forward_only.activation_bytes, whole.activation_bytes))
        counted.append(row)
        # the last forward's window closes at the next forward of the model
        with torch.no_grad():
            model(tokens)
        assert top_saved_tensors_hooks(False) == before
    # the loss's share (whole step minus forward) once the plan of 1 GiB runs
    loss_full = counted[0][-1][1] - counted[0][-1][0]
    loss_budget = counted[1][-1][1] - counted[1][-1][0]
    assert loss_full == loss_budget > 0
