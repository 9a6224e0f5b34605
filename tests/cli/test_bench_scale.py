"""``python -m remat_dist bench --scale`` on a tiny configuration (4 and 8 simulated
ranks against one real TCPStore, 2 steps): what a user relies on, that the step
agreement's store traffic per rank does not grow with the number of checkpoints."""

from __future__ import annotations

import json

from remat_dist.cli.bench_scale import ROW_KEYS
from remat_dist.cli.main import main


def _run_tiny(tmp_path, capsys):
    out = tmp_path / "scale.json"
    rc = main(
        ["bench", "--scale", "--ranks", "4", "8", "--checkpoints", "8", "64",
         "--steps", "2", "--workers", "2", "--timeout", "20", "--budget", "60",
         "--json", str(out)]
    )
    printed = capsys.readouterr().out
    return rc, printed, json.loads(out.read_text())


def test_bench_scale_tiny(tmp_path, capsys):
    rc, printed, data = _run_tiny(tmp_path, capsys)
    assert rc == 0, printed
    assert {"machine", "torch", "date", "rows"} <= data.keys()
    rows = {(r["ranks"], r["checkpoints"], r["design"]): r for r in data["rows"]}
    assert len(rows) == 8  # 2 rank counts x 2 checkpoint counts x 2 designs
    for row in data["rows"]:
        assert set(ROW_KEYS) <= row.keys()
        assert row["errors"] == 0, row["first_error"]  # every simulated rank
    for n in (4, 8):
        few, many = rows[n, 8, "step"], rows[n, 64, "step"]
        assert not few["estimated"] and not many["estimated"]
        # constant in checkpoints: one exchange and one report per step
        for key in ("requests_per_rank_mean", "server_requests_per_step"):
            assert few[key] == many[key], key
        # 8 per rank, plus 2 for the rank that judges a round (the last to arrive)
        for row in (few, many):
            assert row["requests_per_rank_mean"] <= 8 + 4 / n
            assert row["requests_per_rank_max"] <= 12
        # the per-checkpoint design it replaces grows with the checkpoints
        old8, old64 = rows[n, 8, "per-checkpoint"], rows[n, 64, "per-checkpoint"]
        assert not old8["estimated"]
        assert old8["requests_per_rank_mean"] >= 8 * few["requests_per_rank_mean"]
        assert old64["requests_per_rank_mean"] >= 7 * old8["requests_per_rank_mean"]
    assert "per-checkpoint" in printed and "server req/s" in printed
