"""``python -m benchmarks.budget_pipeline`` end to end on two gloo processes
(tiny sizes): the V-shaped schedules' rows."""

from __future__ import annotations

import json

import pytest

from remat_dist._torch import TORCH_RELEASE
from tests.benchmarks._run import run_benchmark

pytestmark = pytest.mark.slow


@pytest.mark.skipif(
    TORCH_RELEASE < (2, 12),
    reason="the V-shaped schedules on 2 ranks need torch 2.12 (on 2.11 gloo fails: "
    "Pair is not connected)",
)
@pytest.mark.parametrize("schedule", ["ScheduleZBVZeroBubble", "ScheduleDualPipeV"])
def test_v_shaped_rows_hold_the_rank_budget_with_the_loss(tmp_path, schedule):
    """Rank 0 holds the first stage and the last (with the loss): with one budget
    shared by each rank's two stage modules, planned against the concurrent
    peak or the sum bound, every rank's peak of every byte saved, the loss
    included, is within the budget and at least the forwards' share; the plan
    names each rank's four blocks."""
    path = tmp_path / "bp.json"
    proc = run_benchmark("budget_pipeline", "--schedules", schedule, "--layers", "2",
                         "--iters", "1", "--fractions", "0.5", "--no-uniform",
                         "--json", str(path), timeout=600)
    rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
    assert {"none", "full", "shared", "sum", "split"} == set(rows)
    for variant in ("shared", "sum"):
        row = rows[variant]
        assert row["schedule"] == schedule and row["fits"], row
        for peak, forward in zip(row["peak_per_rank"], row["forward_peak_per_rank"]):
            assert forward <= peak <= row["budget"]
        assert [len(d) for d in row["decisions"]] == [2, 2]
    assert rows["none"]["peak_per_rank"][0] > rows["shared"]["budget"]
    assert schedule[:14] in proc.stdout
