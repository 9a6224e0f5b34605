"""``python -m benchmarks.budget`` end to end on 2 torchrun ranks (tiny sizes)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_bench_sweep_small(tmp_path):
    """Every budget's plan fits on both ranks; rank 1 saves more."""
    from benchmarks.budget import format_budget_table, main

    path = tmp_path / "budget.json"
    argv = ["--layers", "3", "--dim", "32", "--seq", "16", "--iters", "1",
            "--warmup", "0", "--fractions", "0.3", "0.7", "--json", str(path)]
    assert main(argv) == 0
    result = json.loads(path.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["none", "full", "budget 0.30", "budget 0.70"]
    assert result["batch_per_rank"] == [2, 4]
    for name in ("budget 0.30", "budget 0.70"):
        r = rows[name]
        assert max(r["saved_bytes_per_rank"]) <= r["budget"]
        assert r["saved_bytes_per_rank"][0] < r["saved_bytes_per_rank"][1]
        assert len(r["decisions"]) == 3
    assert "budget 0.30" in format_budget_table(result)
