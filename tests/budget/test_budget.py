"""``MemoryBudget``: single process. The solver against brute force, and the reference
GPT (6 blocks, dropout) under three budgets between full recompute and no
checkpointing: saved bytes within the budget, gradients bitwise those of no
checkpointing (the profiling step's too), a larger budget never gives a slower plan.

The distributed half (2 gloo ranks, unequal batches) is tests/budget/test_budget_dist.py.
"""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import torch
import torch.nn.functional as F

import remat_dist as remat
from remat_dist import RematUsageError, apply_remat, remove_remat
from remat_dist.budget import current_plan, parse_bytes
from remat_dist.budget._profile import human
from remat_dist.budget._solver import brute_force, plan_cost, solve
from remat_dist.models import GPT, Block, GPTConfig, make_batch
from remat_dist.testing import SavedBytesCounter
from remat_dist.wrap import PLANNER_ATTR, BlockInstaller, checkpointed_blocks

CFG = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=6, dropout=0.1)
STEPS = 3  # the profiling step and two under the plan


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny ops: one intra-op thread (two threads spinning on a shared 2-core
    machine made these tests 20x slower); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- shared with test_budget_dist.py ---------------------------------------------


def run_steps(model, batch, steps: int = STEPS, seed: int = 0):
    """``steps`` forward+backward on ``batch`` (dropout reseeded per step): per step
    the bytes a ``SavedBytesCounter`` saw around ``model(tokens)`` and the grads."""
    tokens, targets = batch
    out = []
    for step in range(steps):
        torch.manual_seed(seed * 100 + step)
        with SavedBytesCounter(model.parameters()) as count:
            logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad
            grads[name] = (g.to_local() if hasattr(g, "to_local") else g).clone()
        model.zero_grad(set_to_none=True)
        out.append((count.activation_bytes, grads))
    return out


def grads_equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def plan_time_on(plan, table) -> float:
    """The recompute time of ``plan``'s decisions priced with another plan's
    measurements (``table``: ``BudgetPlan``), summed in block order."""
    return sum(b.candidates[d.decision][1] for b, d in zip(table.blocks, plan.blocks))


def check_larger_budget_not_slower(plans) -> None:
    """Budgets ascending. Bytes are deterministic (same model, same batch), so a
    smaller budget's plan also fits a larger one: priced with the larger budget's
    own measurements it can be no faster than the plan chosen there (the solver is
    exact). Noise-free, unlike comparing wall times or times measured in different
    runs on a busy 2-core machine."""
    for k, big in enumerate(plans):
        for small in plans[:k]:
            assert small.predicted_bytes <= big.budget
            assert plan_time_on(big, big) <= plan_time_on(small, big) + 1e-12


# -- solver ------------------------------------------------------------------------


def test_solver_equals_brute_force_on_random_tables():
    rng = random.Random(0)
    for trial in range(150):
        n = rng.randint(1, 8)
        k = rng.randint(2, 4) if n > 6 else rng.randint(2, 5)
        costs = []
        for _ in range(n):
            block = sorted(
                (rng.randint(0, 50) * rng.choice((1, 7, 1000)), rng.random()) for _ in range(k)
            )
            costs.append(block)
        lo = sum(min(w for w, _ in b) for b in costs)
        hi = sum(max(w for w, _ in b) for b in costs)
        for cap in (lo - 1, lo, (lo + hi) // 3, (lo + hi) // 2, hi, hi + 5):
            got, ref = solve(costs, cap), brute_force(costs, cap)
            if ref is None:
                assert got is None, (trial, cap)
                continue
            assert got is not None, (trial, cap)
            assert plan_cost(costs, got)[0] <= cap
            assert plan_cost(costs, got)[1] == plan_cost(costs, ref)[1], (trial, cap)


def test_solver_thins_large_frontiers_and_stays_feasible(monkeypatch):
    import remat_dist.budget._solver as solver

    monkeypatch.setattr(solver, "MAX_FRONTIER", 8)
    rng = random.Random(1)
    costs = [[(rng.randint(0, 10**6), rng.random()) for _ in range(4)] for _ in range(12)]
    cap = sum(max(w for w, _ in b) for b in costs) // 2
    got = solver.solve(costs, cap)
    assert got is not None and plan_cost(costs, got)[0] <= cap


# -- the reference GPT ---------------------------------------------------------------


def _model(policy=None):
    model = GPT(CFG)
    if policy is not None:
        apply_remat(model, blocks=Block, policy=policy)
    return model


def test_three_budgets_single_process(caplog):
    batch = make_batch(CFG, 4, seed=0)
    ref = run_steps(_model(), batch)
    none_bytes = ref[0][0]
    full_bytes = run_steps(_model("full"), batch, steps=1)[0][0]
    assert full_bytes < none_bytes
    plans = []
    for frac in (0.25, 0.5, 0.75):
        budget = int(full_bytes + frac * (none_bytes - full_bytes))
        model = _model(remat.MemoryBudget(bytes=budget))
        with caplog.at_level(logging.INFO, logger="remat_dist"):
            runs = run_steps(model, batch)
        plan = current_plan(model)
        assert plan is not None and plan.budget == budget
        assert "MemoryBudget plan for the model of blocks" in caplog.text
        # the profiling step runs full recompute; then the plan
        assert runs[0][0] == full_bytes
        for step, ((saved, grads), (_, ref_grads)) in enumerate(zip(runs, ref)):
            assert saved <= budget, (frac, step, saved, budget)
            assert grads_equal(grads, ref_grads), (frac, step)
        # one process: the prediction is exact, and what the planner counted
        # (the counter sees the forward; the plan adds what the loss saves)
        assert plan.measured_bytes == runs[1][0] == plan.predicted_bytes - plan.loss_bytes
        # 25% of the way allows more than one block without checkpoint, 75% not all
        decisions = {b.decision for b in plan.blocks}
        assert decisions != {"full"} and decisions != {"none"}
        kept = {n: s.regions for n, s in checkpointed_blocks(model).items()}
        for b in plan.blocks:
            assert (b.name in kept) == (b.decision != "none")
            if b.regions:
                assert kept[b.name] == b.regions
        # optimal on its own measurements: brute force over all 5**6 plans
        costs = [[b.candidates[label] for label in b.candidates] for b in plan.blocks]
        cap = budget - plan.outside_bytes - plan.loss_bytes
        best = brute_force(costs, cap)
        chosen = [list(b.candidates).index(b.decision) for b in plan.blocks]
        assert plan_cost(costs, chosen)[1] == plan_cost(costs, best)[1]
        plans.append(plan)
    # attention kept costs a third of no checkpoint's bytes for about half the
    # time: some plan uses it (timing noise decides which blocks, not whether)
    assert {b.decision for p in plans for b in p.blocks} - {"full", "none"}
    check_larger_budget_not_slower(plans)
    # and on one table the solver's optimum falls as the budget grows
    table = plans[0]
    costs = [[b.candidates[label] for label in b.candidates] for b in table.blocks]
    times = [
        plan_cost(costs, solve(costs, p.budget - table.outside_bytes - table.loss_bytes))[1]
        for p in plans
    ]
    assert times == sorted(times, reverse=True), times


def test_plan_line_says_why_less_recompute_was_not_taken(caplog):
    """Half-way between full recompute and no checkpoint: the plan leaves part
    of the budget unused; for every block that recomputes, the plan names the
    option of less recompute that needs fewest bytes, and that it needs more
    than what is left (the plan's bytes plus it would exceed the budget); the
    logged plan line says so in words. A block that recomputes nothing names
    none."""
    batch = make_batch(CFG, 4, seed=0)
    none_bytes = run_steps(_model(), batch, steps=1)[0][0]
    full_bytes = run_steps(_model("full"), batch, steps=1)[0][0]
    budget = (full_bytes + none_bytes) // 2
    model = _model(remat.MemoryBudget(bytes=budget))
    with caplog.at_level(logging.INFO, logger="remat_dist"):
        run_steps(model, batch)
    plan = current_plan(model)
    left = budget - plan.predicted_peak_bytes
    assert plan.left_bytes == left >= 0
    explained = 0
    for b in plan.blocks:
        cheaper = [(w - b.bytes, label, b.time_s - t)
                   for label, (w, t) in b.candidates.items() if t < b.time_s]
        if not cheaper:
            assert b.cheaper is None, b
            continue
        more, label, saved = min(cheaper)
        assert b.cheaper == (label, saved, plan.in_flight * more), (b, cheaper)
        assert plan.predicted_peak_bytes + b.cheaper[2] > budget  # why: it does not fit
        line = next(r for r in plan.format().splitlines() if r.startswith(f"  {b.name}:"))
        assert (f"{label!r} instead would save {saved * 1e3:.3f} ms of recompute but "
                f"need {human(b.cheaper[2])} more than the {human(left)} left") in line
        explained += 1
    assert explained  # the budget binds: some block recomputes
    assert f"{human(left)} of the budget left" in caplog.text
    assert plan.format() in caplog.text


def test_infeasible_budget_raises_at_end_of_profiling_step():
    batch = make_batch(CFG, 4, seed=0)
    model = _model(remat.MemoryBudget(bytes="10KiB"))
    tokens, targets = batch
    logits = model(tokens)  # the profiling forward itself completes
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    with pytest.raises(RematUsageError, match="smallest feasible budget is") as ei:
        loss.backward()
    assert all(p.grad is not None for p in model.parameters())  # the step's grads
    smallest = int(str(ei.value).split("smallest feasible budget is ")[1].split()[0].replace(",", ""))
    with pytest.raises(RematUsageError, match="smallest feasible budget"):
        model(tokens)  # and every later step, until the budget changes
    # the number named is feasible, exactly: full recompute everywhere
    fit = _model(remat.MemoryBudget(bytes=smallest))
    runs = run_steps(fit, batch)
    assert set(current_plan(fit).decisions().values()) == {"full"}
    assert all(saved <= smallest for saved, _ in runs)


def test_budget_above_no_checkpointing_keeps_everything():
    batch = make_batch(CFG, 2, seed=1)
    ref = run_steps(_model(), batch, steps=2)
    probe = _model(remat.MemoryBudget(bytes="1GiB"))
    run_steps(probe, batch, steps=1)
    loss = current_plan(probe).loss_bytes  # the cross-entropy's, part of the step
    assert loss > 0
    model = _model(remat.MemoryBudget(bytes=ref[0][0] + loss))
    runs = run_steps(model, batch, steps=2)
    assert set(current_plan(model).decisions().values()) == {"none"}
    assert checkpointed_blocks(model) == {}
    assert runs[1][0] == ref[1][0]
    assert grads_equal(runs[1][1], ref[1][1])


def test_regions_override_and_errors():
    model = _model(remat.MemoryBudget(bytes="1MiB", regions=["mlp"]))
    assert current_plan(model) is None  # before the profiling step
    run_steps(model, make_batch(CFG, 2, seed=0), steps=1)
    assert list(current_plan(model).blocks[0].candidates) == ["full", "save mlp", "none"]
    remove_remat(model)
    assert PLANNER_ATTR not in model.__dict__ and checkpointed_blocks(model) == {}
    with pytest.raises(RematUsageError, match="has no MemoryBudget"):
        current_plan(model)
    with pytest.raises(RematUsageError, match=r"block 'layers.0' \(Block\) has no submodule 'mlpp'"):
        _model(remat.MemoryBudget(bytes=1, regions=("mlpp",)))
    with pytest.raises(RematUsageError, match="cannot read '3 parsecs'"):
        remat.MemoryBudget(bytes="3 parsecs")
    with pytest.raises(RematUsageError, match="not per block"):
        _model(lambda name, module: remat.MemoryBudget(bytes=1))
    # a forward that raises during the profiling step leaves no hooks behind and
    # the next step profiles instead
    model = _model(remat.MemoryBudget(bytes="1MiB"))
    with pytest.raises(ValueError, match="exceeds GPTConfig.seq_len"):
        model(torch.zeros(1, CFG.seq_len + 1, dtype=torch.long))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    run_steps(model, make_batch(CFG, 2, seed=0), steps=2)
    assert current_plan(model).measured_bytes is not None
    assert parse_bytes("1.5GiB") == 3 * 2**29
    assert parse_bytes("512 mib") == 2**29 and parse_bytes("2KB") == 2000
    assert parse_bytes(4096) == parse_bytes("4096") == 4096


def test_micro_batches_of_the_profiling_step_and_later_steps():
    """Gradient accumulation: the profiling step's second micro-batch still runs
    full recompute (the plan waits for the step's backward to end); the next step
    runs the plan in both micro-batches; gradients bitwise those without remat."""
    micro = [make_batch(CFG, 2, seed=s) for s in (5, 6)]

    def step(model, seed):
        torch.manual_seed(seed)
        losses, saved = [], []
        for tokens, targets in micro:
            with SavedBytesCounter(model.parameters()) as count:
                logits = model(tokens)
            saved.append(count.activation_bytes)
            losses.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
        sum(losses).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return saved, grads

    ref = [step(_model(), s) for s in (0, 1)]
    full = step(_model("full"), 0)[0][0]
    budget = (full + ref[0][0][0]) // 2
    model = _model(remat.MemoryBudget(bytes=budget))
    first = step(model, 0)
    assert first[0] == [full, full] and current_plan(model).measured_bytes is None
    second = step(model, 1)
    assert all(b <= budget for b in second[0]) and second[0][0] > full
    assert current_plan(model).measured_bytes == second[0][0]
    assert grads_equal(first[1], ref[0][1]) and grads_equal(second[1], ref[1][1])


def test_interleaved_micro_batches_of_the_profiling_step(monkeypatch):
    """1F1B order in the profiling step (F1 F2 B1 F3 B2 B3): two graphs are alive
    at once, so the step is planned for 2 forwards in flight, at its end (B3, the
    latest forward's backward): until then every micro-batch runs full recompute.
    The next step runs the plan; its peak (2 forwards alive) fits the budget;
    gradients bitwise those without remat, in this step and the next. The
    recompute times are fixed (a block 1.0, its attention 0.6, its MLP 0.3), so
    that the plan saves regions whatever this machine's load."""
    from remat_dist.budget import _profile as _budget_profile

    monkeypatch.setattr(
        _budget_profile, "_time_block",
        lambda module, paths, restore, repeats: (
            1.0, {p: 0.6 if "attention" in p else 0.3 for p in paths}
        ),
    )
    micro = [make_batch(CFG, 2, seed=s) for s in (5, 6, 7)]

    def loss_of(model, batch, saved):
        tokens, targets = batch
        with SavedBytesCounter(model.parameters()) as count:
            logits = model(tokens)
        saved.append(count.activation_bytes)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def step(model, seed, plans, saved):
        torch.manual_seed(seed)
        l1, l2 = loss_of(model, micro[0], saved), loss_of(model, micro[1], saved)
        l1.backward()
        plans.append(model.__dict__.get(PLANNER_ATTR) and current_plan(model))
        l3 = loss_of(model, micro[2], saved)
        l2.backward()
        l3.backward()
        plans.append(model.__dict__.get(PLANNER_ATTR) and current_plan(model))
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return grads

    ref = [step(_model(), s, [], []) for s in (0, 1)]
    full = run_steps(_model("full"), micro[0], steps=1)[0][0]
    none = run_steps(_model(), micro[0], steps=1)[0][0]
    budget = full + none  # two forwards in flight, each half-way
    model = _model(remat.MemoryBudget(bytes=budget))
    plans: list = []
    saved: list = []
    first = step(model, 0, plans, saved)
    assert plans[0] is None and plans[1] is not None  # planned at the step's end
    assert saved == [full] * 3
    plan = plans[1]
    assert plan.in_flight == 2 and plan.predicted_peak_bytes == 2 * plan.predicted_bytes
    assert plan.predicted_peak_bytes <= budget
    assert set(plan.decisions().values()) - {"full", "none"}  # regions saved
    saved.clear()
    second = step(model, 1, plans, saved)
    assert plans[2] is plans[3] is plan
    assert max(saved[0] + saved[1], saved[1] + saved[2]) <= budget, saved
    assert grads_equal(first, ref[0]) and grads_equal(second, ref[1])


def test_dropped_sanity_forward_is_profiled_again():
    """A grad-enabled sanity forward on one sample, dropped without backward: the
    next forward (the training batch) profiles again, so the plan fits the batch
    that trains; gradients bitwise those without remat."""
    batch = make_batch(CFG, 8, seed=0)
    ref = run_steps(_model(), batch, steps=2)
    full = run_steps(_model("full"), batch, steps=1)[0][0]
    budget = (full + ref[0][0]) // 2
    model = _model(remat.MemoryBudget(bytes=budget))
    model(batch[0][:1])  # dropped at once
    got = run_steps(model, batch, steps=2)
    plan = current_plan(model)
    assert got[0][0] == full and got[1][0] <= budget  # profiled on the batch of 8
    assert plan.measured_bytes == got[1][0]
    assert all(grads_equal(g, r) for (_, g), (_, r) in zip(got, ref))


def test_loss_from_an_intermediate_installs_the_plan_once(monkeypatch):
    """The loss comes from a block's output caught by a forward hook; the model's
    returned logits require grad and are dropped. No backward goes through the
    output, but the blocks' replays show one ran: the plan is installed at the next
    forward (not re-profiled every step); gradients bitwise those without remat."""
    from remat_dist.budget import _profile as _budget_profile

    calls = []
    profile = _budget_profile.profile_block
    monkeypatch.setattr("remat_dist.budget._planner.profile_block",
                        lambda *a, **k: calls.append(1) or profile(*a, **k))
    tokens, _ = make_batch(CFG, 2, seed=0)

    def steps(model):
        feat, out = {}, []
        blocks = [m for m in model.modules() if isinstance(m, Block)]
        blocks[-1].register_forward_hook(lambda m, i, o: feat.__setitem__("h", o))
        for step in range(3):
            torch.manual_seed(step)
            model(tokens)  # logits dropped
            feat.pop("h").square().mean().backward()
            out.append({n: p.grad.clone() for n, p in model.named_parameters()
                        if p.grad is not None})  # the head gets none here
            model.zero_grad(set_to_none=True)
        return out

    ref = steps(_model())
    model = _model(remat.MemoryBudget(bytes="10MiB"))
    got = steps(model)
    assert len(calls) == CFG.n_layers  # profiled once
    assert current_plan(model) is not None
    assert all(grads_equal(g, r) for g, r in zip(got, ref))


def test_plan_from_a_smaller_sanity_forward_warns_with_the_cause(caplog):
    """The first grad-enabled forward is the profiling one: a sanity forward on one
    sample whose output is kept plans for one sample, and the training batch then
    saves more than the budget. The warning (shown by default: remat_dist adds no
    NullHandler) names both batches' shapes and the fix."""
    tokens, targets = make_batch(CFG, 8, seed=0)
    model = _model(remat.MemoryBudget(bytes="120KiB"))
    kept = model(tokens[:1])  # grad enabled, never backpropagated, still referenced
    with caplog.at_level(logging.WARNING, logger="remat_dist"):
        for _ in range(2):
            with SavedBytesCounter(model.parameters()) as count:
                logits = model(tokens)
            F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    assert count.activation_bytes > 120 * 1024
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "[(1, 16)]" in warned[0] and "[(8, 16)]" in warned[0]
    assert "torch.no_grad()" in warned[0]
    del kept


def test_remove_remat_while_a_graph_is_alive_is_refused():
    """remove_remat between a forward and its backward would make the replay run
    the block without its regions: refused, naming the blocks and the fix; allowed
    once the graph is backpropagated or dropped (retain_graph keeps it alive)."""
    batch = make_batch(CFG, 2, seed=3)
    for policy in ("full", {"attention": "save"}):
        model = _model(policy)
        tokens, targets = batch
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        with pytest.raises(RematUsageError) as ei:
            remove_remat(model)
        msg = str(ei.value)
        assert "'layers.0'" in msg and "Fix: run that backward" in msg
        assert len(checkpointed_blocks(model)) == CFG.n_layers  # nothing was removed
        loss.backward(retain_graph=True)
        with pytest.raises(RematUsageError, match="retain_graph"):
            remove_remat(model)
        del loss
        remove_remat(model)  # the graph is gone
        assert checkpointed_blocks(model) == {}
        apply_remat(model, blocks=Block, policy=policy)
        model(tokens)  # dropped without backward: nothing to replay
        remove_remat(model)


# -- small models for the edge cases ---------------------------------------------------


class _MLP(torch.nn.Module):
    def __init__(self, d: int, bn: bool = False) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.bn = torch.nn.BatchNorm1d(4 * d) if bn else None

    def forward(self, x):
        h = self.a(x)
        if self.bn is not None:
            h = self.bn(h)
        return self.b(F.gelu(h))


class _Blk(torch.nn.Module):
    def __init__(self, d: int = 16, bn: bool = False) -> None:
        super().__init__()
        self.attention = torch.nn.Linear(d, d)
        self.mlp = _MLP(d, bn)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls.add_(1)  # a counter buffer, like an MoE's tokens per expert
        x = x + torch.tanh(self.attention(x))
        return x + self.mlp(x)


@dataclasses.dataclass
class _Out:  # not registered with torch's pytree
    y: torch.Tensor


class _Net(torch.nn.Module):
    """3 blocks; ``out="dict"`` returns ``{"y": ...}``, ``"dataclass"`` an ``_Out``,
    ``"attr"`` None (the output kept as ``self.y``); ``order`` the block calls."""

    def __init__(self, bn: bool = False, out: str = "tensor", order=(0, 1, 2)) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Blk(bn=bn) for _ in range(3)])
        self.head = torch.nn.Linear(16, 1)
        self.out, self.order = out, order

    def forward(self, x):
        for i in self.order:
            x = self.blocks[i](x)
        y = self.head(x)
        if self.out == "attr":
            self.y = y
            return None
        return {"y": y, "dict": {"y": y}, "dataclass": _Out(y)}.get(self.out, y)


def _net(policy=None, **kw):
    torch.manual_seed(0)
    model = _Net(**kw)
    if policy is not None:
        apply_remat(model, blocks=_Blk, policy=policy)
    return model


def _net_steps(model, x, steps=2):
    """Per step: the saved bytes around the forward, and the grads."""
    out = []
    for _ in range(steps):
        with SavedBytesCounter(model.parameters()) as count:
            y = model(x)
        y = y["y"] if isinstance(y, dict) else model.y if y is None else getattr(y, "y", y)
        y.sum().backward()
        out.append((count.activation_bytes, {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    return out


def _between(x, frac=0.5, **kw):
    """A budget ``frac`` of the way from full recompute to no checkpoint."""
    full = _net_steps(_net("full", **kw), x, steps=1)[0][0]
    none = _net_steps(_net(**kw), x, steps=1)[0][0]
    return int(full + frac * (none - full))


@pytest.mark.parametrize("out", ["dict", "dataclass", "attr"])
def test_model_returning_a_dict(out):
    """The end of the profiling step's backward is found through a dict output
    (a ``ModelOutput``) or an unregistered dataclass: the plan waits for it; with no
    tensor in the output it waits for the next forward. Gradients are those
    without remat."""
    x = torch.randn(8, 16)
    ref = _net_steps(_net(out=out), x, steps=3)
    budget = _between(x, out=out)
    model = _net(remat.MemoryBudget(bytes=budget), out=out)
    runs = _net_steps(model, x, steps=3)
    plan = current_plan(model)
    assert plan is not None and plan.measured_bytes == runs[1][0] <= budget
    assert set(plan.decisions().values()) != {"full"}
    for (_, g), (_, r) in zip(runs, ref):
        assert grads_equal(g, r)
    if out != "dict":
        return
    # infeasible: raised at the end of the backward, not in the forward
    model = _net(remat.MemoryBudget(bytes=1), out="dict")
    y = model(x)
    with pytest.raises(RematUsageError, match="cannot be met"):
        y["y"].sum().backward()


def test_profiling_passes_leave_buffers_and_inputs_alone():
    """The side passes run on copies of the inputs and put the block's buffers
    back: BatchNorm statistics and counters as under the "full" policy (whose
    replay updates them once more, a torch.utils.checkpoint behaviour)."""
    from remat_dist.budget._profile import candidates, profile_block

    x = torch.randn(8, 16)
    full, budget = _net("full", bn=True), _net(remat.MemoryBudget(bytes="10MiB"), bn=True)
    for model in (full, budget):
        _net_steps(model, x, steps=1)
    assert torch.equal(budget.blocks[0].calls, torch.tensor(2))  # forward + replay
    for (name, a), b in zip(full.named_buffers(), budget.buffers()):
        assert torch.equal(a, b), name

    # one block on its own: an in-place update of its input stays in the copies
    class AddIn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = torch.nn.Linear(16, 16)
            self.register_buffer("scale", torch.ones(16))

        def forward(self, h):
            h.add_(1.0)
            return self.mlp(h) * self.scale

    block = AddIn()
    apply_remat(torch.nn.Sequential(block), blocks=AddIn, policy="full")
    h = torch.randn(4, 16, requires_grad=True) * 1.0  # a non-leaf, as in a model
    before = h.detach().clone()
    installer = BlockInstaller([("b", block)], None, "replay", "none")
    row = profile_block(installer, 0, candidates("b", block, None), (h,), {},
                        params=set(), repeats=1)
    assert set(row) == {"full", "save mlp", "none"}
    assert torch.equal(h, before) and h._version == 0
    assert block.scale._version == 0  # an untouched buffer is not written back
    # and in a model the real pass still sees it: the same error as under "full"
    for policy in ("full", remat.MemoryBudget(bytes="1MiB")):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), AddIn(), AddIn())
        apply_remat(model, blocks=AddIn, policy=policy)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            model(torch.randn(4, 16)).sum().backward()


def test_plan_installed_when_the_first_forward_is_not_backpropagated():
    x = torch.randn(8, 16)
    model = _net(remat.MemoryBudget(bytes="10MiB"))
    kept = model(x)  # e.g. a sanity forward; never backpropagated, still referenced
    assert current_plan(model) is None  # chosen, not yet running
    runs = _net_steps(model, x, steps=2)
    plan = current_plan(model)
    assert set(plan.decisions().values()) == {"none"} and checkpointed_blocks(model) == {}
    assert plan.measured_bytes == runs[1][0] > runs[0][0]
    del kept


def test_block_never_called_raises_naming_it():
    x = torch.randn(8, 16)
    model = _net(remat.MemoryBudget(bytes="10MiB"), order=(0, 1))
    y = model(x)
    with pytest.raises(RematUsageError, match=r"never ran in the profiling forward: 'blocks.2'"):
        y.sum().backward()
    assert all(p.grad is not None for p in model.blocks[0].parameters())
    with pytest.raises(RematUsageError, match="'blocks.2'"):
        model(x)  # and every later forward
    assert current_plan(model) is None


def test_block_called_twice_counts_both_calls():
    x = torch.randn(64, 16)
    order = (0, 1, 2, 0, 1, 2)  # shared weights: each block runs twice
    budget = _between(x, 0.6, order=order)
    model = _net(remat.MemoryBudget(bytes=budget), order=order)
    runs = _net_steps(model, x)
    plan = current_plan(model)
    assert plan.measured_bytes == plan.predicted_bytes == runs[1][0] <= budget
    assert set(plan.decisions().values()) != {"full"}


def test_regions_validated_and_failed_profiling_leaves_no_patch():
    for regions, match in ((("mlp", "mlp"), "more than once"), (("",), "non-empty"),
                           ((1,), "non-empty")):
        with pytest.raises(RematUsageError, match=match):
            remat.MemoryBudget(bytes=1, regions=regions)
    assert remat.MemoryBudget(bytes=1, regions="mlp").regions == ("mlp",)
    shared = _net()
    shared.blocks[1].attention = shared.blocks[0].attention
    with pytest.raises(RematUsageError, match="blocks.1.attention is also blocks.0.attention"):
        apply_remat(shared, blocks=_Blk, policy=remat.MemoryBudget(bytes=1))
    # a profiling forward that fails inside a side pass (forced past validation)
    budget = remat.MemoryBudget(bytes=3000, regions=("mlp",))
    object.__setattr__(budget, "regions", ("mlp", "mlp"))
    model = _net(budget)
    with pytest.raises(RematUsageError, match="entered twice"):
        model(torch.randn(8, 16))
    remove_remat(model)
    left = [(n, k) for n, m in model.named_modules() for k in m.__dict__
            if k in ("_call_impl", "forward") or k.startswith("_remat_dist")]
    assert left == []
    model(torch.randn(8, 16)).sum().backward()


def test_byte_counts_edges():
    assert parse_bytes("1.1KB") == 1100 and parse_bytes(2.0) == 2
    for bad, match in (("1e400", "out of range"), ("0.5", "not a whole number"),
                       (1.5, "not a whole number"), ("1e-3", "not a whole number"),
                       (2**64, "out of range")):
        with pytest.raises(RematUsageError, match=match):
            remat.MemoryBudget(bytes=bad)


def test_infeasible_message_names_the_smallest_plan():
    """A block that saves nothing itself: its smallest option is no checkpoint."""

    class Shift(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = torch.nn.Parameter(torch.zeros(16))

        def forward(self, h):
            return h + self.b  # saves nothing for backward

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), Shift(), Shift(), torch.nn.Linear(16, 1))
    apply_remat(model, blocks=Shift, policy=remat.MemoryBudget(bytes=1))
    with pytest.raises(RematUsageError, match="each block at its fewest bytes: 'none' for 2 blocks"):
        model(torch.randn(8, 16)).sum().backward()


def test_plan_mismatch_keeps_raising(monkeypatch):
    import remat_dist.budget._planner as budget_mod
    from remat_dist.errors import PlanMismatchError

    model = _net(remat.MemoryBudget(bytes="1MiB"))
    monkeypatch.setattr(budget_mod, "dist_ready", lambda: True)
    monkeypatch.setattr(budget_mod, "_agreeing_groups", lambda state: [None])
    monkeypatch.setattr(budget_mod, "_global_rank", lambda: 0)
    monkeypatch.setattr(  # "rank 1" has other candidates
        budget_mod, "all_gather_objects",
        lambda obj, group=None: [obj, [
            dict(r, rank=1, labels=[["full", "none"]] * len(r["labels"])) for r in obj
        ]],
    )
    x = torch.randn(8, 16)
    with pytest.raises(PlanMismatchError, match="rank 1 has other candidates"):
        model(x).sum().backward()  # planned at the end of the profiling step
    calls = []
    model.blocks[0].attention.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(PlanMismatchError, match="other candidates"):
        model(x)  # no silent re-profiling
    assert calls == [] and current_plan(model) is None
