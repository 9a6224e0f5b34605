"""The memory budget in the cross-rank report, and one budget shared by several
models on a rank.

* On real gloo processes (2 pipeline stages, Schedule1F1B, ``measure_peak=True``):
  ``gather_saved_tensors_report()`` after each step shows every rank's peak over
  that step, byte for byte what ``PeakSavedBytes(whole_step=True)`` measured
  (the loss included), at or under the budget, the imbalance max/mean of those peaks, and each stage's plan as
  ``current_plan`` gives it.
* In one process: the report's budget part aggregated from per-rank sections,
  formatted and read back from its dict; one ``MemoryBudget`` object given to two
  models plans them jointly (the brute-force optimum of the joint problem), too
  small it names both, and separate objects keep separate budgets.
"""

from __future__ import annotations

import importlib.util
import json
import statistics

import pytest
import torch
import torch.nn.functional as F

import remat_dist as remat
from remat_dist.report import BudgetReport, aggregate_summaries
from remat_dist.testing import DistContext, PeakSavedBytes, distributed
from tests.budget._joint_check import joint_optimum

pytest.importorskip("torch.distributed.pipelining")

from remat_dist.models import make_batch  # noqa: E402  (isort: after the skip)
from tests.budget.test_budget import _Blk  # noqa: E402
from tests.budget.test_budget_pipeline import _build  # noqa: E402
from tests.distributed.test_pipeline import BATCH, CONFIG, MICRO_BATCHES, _loss_fn  # noqa: E402


def _pipeline(policy, pp, stage: int, steps: int):
    """``steps`` 1F1B steps on this rank's stage of 2; after each, the cross-rank
    report (a collective: both ranks call it) and this rank's peak of every byte
    saved (``PeakSavedBytes(whole_step=True)``)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as sch

    module = _build(stage, policy)
    meter = PeakSavedBytes(module, whole_step=True)
    pipe = PipelineStage(module, stage, 2, torch.device("cpu"), group=pp)
    schedule = sch.Schedule1F1B(pipe, n_microbatches=MICRO_BATCHES, loss_fn=_loss_fn)
    peaks, reports = [], []
    for step in range(steps):
        tokens, targets = make_batch(CONFIG, BATCH, seed=100 + step)
        module.zero_grad(set_to_none=True)
        meter.reset()
        with meter:
            if stage == 0:
                schedule.step(tokens)
            else:
                schedule.step(target=targets, losses=[])
        peaks.append(meter.peak)
        reports.append(remat.gather_saved_tensors_report())
    return module, peaks, reports


@pytest.mark.skipif(
    importlib.util.find_spec("numpy") is None,
    reason="torch.distributed.pipelining exchanges stage metadata with "
    "recv_object_list, which needs numpy (torch's need, not remat_dist's)",
)
@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("pp",), timeout=180)
def test_cross_rank_report_shows_each_ranks_step_peak(ctx: DistContext):
    """1F1B, 2 stages, MemoryBudget(measure_peak=True) half-way between full
    recompute's peak and no checkpoint's: the report gathered after steps 1 and 2
    gives each rank's peak of that step exactly as
    PeakSavedBytes(whole_step=True) measured it (the loss included), at or under the budget; the imbalance is max/mean of those peaks; each rank
    shows its stage, its forwards in flight and its plan as current_plan has it."""
    pp, stage = ctx.mesh.get_group(), ctx.rank
    _, none_peaks, _ = _pipeline(None, pp, stage, steps=1)
    _, full_peaks, _ = _pipeline("full", pp, stage, steps=1)
    lo = max(ctx.all_gather_object(full_peaks[0]))
    hi = max(ctx.all_gather_object(none_peaks[0]))
    budget = (lo + hi) // 2
    module, peaks, reports = _pipeline(
        remat.MemoryBudget(bytes=budget, measure_peak=True), pp, stage, steps=3
    )
    plan = remat.budget.current_plan(module)
    assert plan is not None
    mine = (peaks, tuple(plan.decisions().items()), plan.in_flight,
            plan.predicted_peak_bytes)
    everyone = ctx.all_gather_object(mine)
    if stage != 0:
        assert all(r is None for r in reports)
        return
    for step in (1, 2):
        report = reports[step]
        assert report is not None and report.budget is not None
        got = report.budget
        step_peaks = [everyone[r][0][step] for r in range(2)]
        assert [r.peak_bytes for r in got.ranks] == step_peaks, (step, step_peaks, got)
        assert all(p <= budget for p in step_peaks)
        assert got.peaks is not None
        assert got.peaks.imbalance == max(step_peaks) / statistics.mean(step_peaks)
        assert got.peaks.max == max(step_peaks) and got.peaks.min == min(step_peaks)
        assert got.peaks.max_rank == step_peaks.index(max(step_peaks))
        for r, rank in enumerate(got.ranks):
            _, decisions, in_flight, predicted = everyone[r]
            assert rank.rank == r and rank.budget_bytes == budget
            assert rank.predicted_peak_bytes == predicted <= budget
            (st,) = rank.stages
            assert st.decisions == decisions and st.in_flight == in_flight
            assert st.blocks == (f"layers.{2 * r}", f"layers.{2 * r + 1}")
        # the loss's share: none on the first stage, the loss_fn's on the last
        assert got.ranks[0].loss_bytes_at_peak == 0
        assert 0 < got.ranks[1].loss_bytes_at_peak < got.ranks[1].peak_bytes
        text = report.format()
        assert "memory budget, peak per rank since the previous report: max" in text, text
        assert "the model of blocks 'layers.0'..'layers.1', 2 in flight:" in text, text
        assert "the model of blocks 'layers.2'..'layers.3', 1 in flight:" in text, text
        rank1 = next(line for line in text.splitlines() if line.startswith("  rank 1: peak"))
        assert "% of it)" in rank1 and "(loss " in rank1, text  # the loss's share
        back = remat.report.CrossRankReport.from_dict(json.loads(json.dumps(report.to_dict())))
        assert back == report


def _section(budget, peak, models, predicted):
    return {"budgets": [{"budget": budget, "peak_bytes": peak,
                         "predicted_peak_bytes": predicted, "models": models}]}


def _summary(rank, total, budget=None):
    s = {"rank": rank, "total_bytes": total, "outside_regions_bytes": 0,
         "checkpoint_input_bytes": 0, "regions": []}
    if budget is not None:
        s["budget"] = budget
    return s


def test_budget_report_aggregates_formats_and_round_trips():
    """Per-rank budget sections (as remat_dist.budget gives them) aggregate into
    min / median / max / heaviest / imbalance of the peaks, format one line per
    rank and per stage model, and read back from the dict; a report without
    budgets has no "budget" key (the schema of before)."""
    model = lambda name, k, decisions: {  # noqa: E731
        "name": name, "blocks": [b for b, _ in decisions], "in_flight": k,
        "decisions": [list(d) for d in decisions], "predicted_peak_bytes": 100 * k,
        "phase": "planned",
    }
    s0 = _section(4000, 3000, [model("stage a", 2, [("layers.0", "full"),
                                                     ("layers.1", "save mlp")]),
                               model("stage c", 1, [("layers.4", "none")])], 3900)
    s1 = _section(4000, 1000, [model("stage b", 1, [("layers.2", "none")])], 1200)
    s2 = _section(4000, 2000, [model("stage d", 1, [("layers.3", "full")])], 2100)
    report = aggregate_summaries([_summary(2, 10, s2), _summary(0, 10, s0),
                                  _summary(1, 10, s1)])
    b = report.budget
    assert b is not None and [r.rank for r in b.ranks] == [0, 1, 2]
    assert [r.peak_bytes for r in b.ranks] == [3000, 1000, 2000]
    assert b.peaks is not None
    assert (b.peaks.min, b.peaks.median, b.peaks.max, b.peaks.max_rank) == (1000, 2000, 3000, 0)
    assert b.peaks.imbalance == 1.5
    assert [st.name for st in b.ranks[0].stages] == ["stage a", "stage c"]
    assert b.ranks[0].stages[0].decisions == (("layers.0", "full"), ("layers.1", "save mlp"))
    text = report.format()
    assert ("memory budget, peak per rank since the previous report: max 2.9 KiB on "
            "rank 0, median 2.0 KiB, min 1000 B, imbalance 1.50 (max/mean)") in text, text
    assert "  rank 0: peak 2.9 KiB = 75% of budget 3.9 KiB, plan bound 3.8 KiB  <- heaviest" in text
    assert "    stage a, 2 in flight: layers.0 full, layers.1 save mlp" in text
    assert "    stage c, 1 in flight: layers.4 none" in text
    d = json.loads(json.dumps(report.to_dict()))
    assert list(d) == ["world_size", "ranks", "regions", "totals", "budget"]
    assert remat.report.CrossRankReport.from_dict(d) == report
    assert BudgetReport.from_dict(d["budget"]) == b
    # no budget anywhere: no key; a peak not measured: said so, no statistics
    plain = aggregate_summaries([_summary(0, 10), _summary(1, 20)])
    assert plain.budget is None and "budget" not in plain.to_dict()
    unmeasured = aggregate_summaries([_summary(0, 10, _section(4000, None, [], 0))])
    assert unmeasured.budget is not None and unmeasured.budget.peaks is None
    assert "peaks not measured (MemoryBudget(bytes=..., measure_peak=True)" in unmeasured.format()
    assert remat.report.CrossRankReport.from_dict(unmeasured.to_dict()) == unmeasured


def test_report_without_process_group_shows_this_ranks_budget():
    """One process, measure_peak=True: the report gathered after each step shows
    the peak of that step (what PeakSavedBytes saw), the plan, and restarts its
    window at each call. In a fresh process: the report shows every budget alive
    in the process, and models of other tests that failed their profiling step
    may still be alive in a pytest worker."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_report_in_one_process)
    child.start()
    child.join(120)
    assert child.exitcode == 0, f"the one-process report check failed (exit {child.exitcode})"


def _report_in_one_process():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    probe = _Stage()
    counter = PeakSavedBytes(probe)
    probe(x).sum().backward()
    budget = counter.peak * 3 // 4
    torch.manual_seed(0)
    net = _Stage()
    remat.apply_remat(net, blocks=_Blk,
                      policy=remat.MemoryBudget(bytes=budget, measure_peak=True))
    meter = PeakSavedBytes(net)
    for step in range(3):
        meter.reset()
        net(x).sum().backward()
        report = remat.gather_saved_tensors_report()
        assert report is not None and report.budget is not None
        (rank,) = report.budget.ranks
        if step == 0:
            # planned at the end of this step: the window opened then, nothing since
            assert rank.peak_bytes == 0
            continue
        assert rank.peak_bytes == meter.peak <= budget
        plan = remat.budget.current_plan(net)
        assert rank.stages[0].decisions == tuple(plan.decisions().items())
    assert report.budget.peaks.imbalance == 1.0


# -- one budget shared by several models on a rank ------------------------------


class _Stage(torch.nn.Module):
    """Three blocks and a norm: a stage whose output feeds the next."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Blk() for _ in range(3)])
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def _two_models(policy_a, policy_b=None):
    torch.manual_seed(0)
    a, b = _Stage(), _Stage()
    if policy_a is not None:
        remat.apply_remat(a, blocks=_Blk, policy=policy_a)
        remat.apply_remat(b, blocks=_Blk, policy=policy_a if policy_b is None else policy_b)
    return a, b


def _step_both(a, b, x):
    """Forward a, forward b on a's output (two stages on one rank), one backward:
    both models' graphs alive at once, as an interleaved schedule keeps them."""
    out = b(a(x))
    F.mse_loss(out, torch.zeros_like(out)).backward()


def _peak_bytes(a, b, x) -> int:
    """The peak of every byte saved in one step of both (the loss included)."""
    meter = PeakSavedBytes(a, b, whole_step=True)
    with meter:
        _step_both(a, b, x)
    return meter.peak


def test_shared_budget_plans_two_models_jointly():
    """One MemoryBudget object given to two models: both plan at the end of the
    later profiling step, for one budget: the rank's predicted peak (both
    models' forwards alive at once, the loss after the second) fits it, the
    measured peak of every byte saved does too, and the joint plan is the
    brute-force optimum over every candidate of every block of both models."""
    x = torch.randn(8, 16)
    lo = _peak_bytes(*_two_models("full"), x)
    hi = _peak_bytes(*_two_models(None), x)
    for frac in (0.3, 0.7):
        budget = int(lo + frac * (hi - lo))
        a, b = _two_models(remat.MemoryBudget(bytes=budget))
        _step_both(a, b, x)
        pa, pb = remat.budget.current_plan(a), remat.budget.current_plan(b)
        assert pa is not None and pb is not None
        assert pa.shared_by == pb.shared_by == 2
        assert pa.concurrent == pb.concurrent == ((1, 1),)
        assert pa.rank_peak_bytes == pb.rank_peak_bytes == (
            pa.predicted_peak_bytes + pb.predicted_peak_bytes) <= budget
        assert pb.loss_bytes > 0 and pa.loss_bytes == 0
        assert _peak_bytes(a, b, x) <= budget
        chosen = pa.predicted_time_s + pb.predicted_time_s
        assert chosen == joint_optimum([pa, pb], budget)
        assert set(pa.decisions().values()) | set(pb.decisions().values()) != {"none"}


def _apart(a, b, x):
    """Two forwards of a alive at once; after the first one's backward, one of
    b and its backward; then the second one's: a's 2 never meet b's 1."""
    first, second = a(x), a(x + 1)
    F.mse_loss(first, torch.zeros_like(first)).backward()
    out = b(x)
    F.mse_loss(out, torch.zeros_like(out)).backward()
    F.mse_loss(second, torch.zeros_like(second)).backward()


@pytest.mark.parametrize("plan_against", ["peak", "sum"])
def test_shared_budget_plans_against_the_peak_or_the_sum(plan_against):
    """Models sharing a budget whose own peaks never coincide (a keeps 2
    forwards alive, b 1 while a keeps 1): planned against the measured peak,
    the moments are (2, 0) and (1, 1); with ``plan_against="sum"``, both at
    their own peak at once, (2, 1), the predicted rank peak the sum of their
    own peaks. Either way the measured peak of a step fits the prediction."""
    x = torch.randn(8, 16)
    budget = 10**9
    policy = remat.MemoryBudget(bytes=budget, plan_against=plan_against)
    a, b = _two_models(policy)
    _apart(a, b, x)
    pa, pb = remat.budget.current_plan(a), remat.budget.current_plan(b)
    assert (pa.in_flight, pb.in_flight) == (2, 1)
    if plan_against == "sum":
        assert pa.concurrent == ((2, 1),)
        assert pa.rank_peak_bytes == pa.sum_bound_bytes
    else:
        assert set(pa.concurrent) == {(2, 0), (1, 1)}
        assert pa.rank_peak_bytes < pa.sum_bound_bytes
    meter = PeakSavedBytes(a, b, whole_step=True)
    with meter:
        _apart(a, b, x)
    assert meter.peak <= pa.rank_peak_bytes <= budget


def test_plan_against_is_checked():
    with pytest.raises(remat.RematUsageError, match="'peak'.*'sum'"):
        remat.MemoryBudget(bytes=1, plan_against="max")


def test_shared_budget_too_small_names_every_model():
    """Below the two models' peaks at full recompute together (each alone would
    fit): the error, at the end of the profiling step, names both models, their
    peaks at full recompute, the sum and the budget; both raise it again."""
    x = torch.randn(8, 16)
    a, b = _two_models(remat.MemoryBudget(bytes=1))
    meter = PeakSavedBytes(a, b)
    with pytest.raises(remat.RematUsageError) as ei:
        _step_both(a, b, x)
    msg = str(ei.value)
    assert msg.startswith("remat_dist.MemoryBudget: a budget of 1 bytes (1 B) shared by 2 "
                          "models on this rank cannot be met:"), msg
    assert msg.count("the model of blocks 'blocks.0'..'blocks.2'") == 2, msg
    smallest = int(msg.split("together ")[1].split()[0].replace(",", ""))
    assert smallest >= meter.peak  # full recompute's peak of both, an upper bound
    assert f"Fix: MemoryBudget(bytes={smallest}) or more" in msg
    for model in (a, b):
        with pytest.raises(remat.RematUsageError, match="shared by 2 models"):
            model(x)


def test_separate_budget_objects_keep_separate_budgets():
    """Two equal MemoryBudget objects are two budgets: each model plans alone,
    at the end of its own profiling step, each within the whole budget."""
    x = torch.randn(8, 16)
    lo = _peak_bytes(*_two_models("full"), x)
    budget = lo  # fits each model alone with room, not both at full recompute
    a, b = _two_models(remat.MemoryBudget(bytes=budget), remat.MemoryBudget(bytes=budget))
    _step_both(a, b, x)
    for m in (a, b):
        plan = remat.budget.current_plan(m)
        assert plan.shared_by == 1 and plan.rank_peak_bytes == plan.predicted_peak_bytes
        assert plan.predicted_peak_bytes <= budget
