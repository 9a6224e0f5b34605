"""``python -m benchmarks.scale`` on a tiny configuration: a stake of 2 and stakes of
4 among 8 simulated ranks, each on a real ``StakeGroup``; the modelled rows at
16,384 ranks follow."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_bench_scale_tiny(tmp_path, capsys):
    from benchmarks.scale import ROW_KEYS, main

    out = tmp_path / "scale.json"
    rc = main(
        ["--ranks", "2", "8", "--group", "4", "--steps", "3", "--workers", "2",
         "--timeout", "20", "--json", str(out)]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    data = json.loads(out.read_text())
    assert {"machine", "torch", "date", "rows"} <= data.keys()
    rows = data["rows"]
    for row in rows:
        assert set(ROW_KEYS) <= row.keys(), row
        assert not row.get("errors"), row.get("first_error")
    run = [r for r in rows if not r["modelled"]]
    assert [(r["design"], r["ranks"], r["group"]) for r in run] == [
        ("stake group", 2, 2), ("stake group", 8, 4)
    ]
    two, eight = run
    # one gloo operation per round, two rounds per step (the agreement and the
    # report), whatever the stake's size; the store sees nothing once the groups
    # are made, and something while they are made
    for r in (two, eight):
        assert r["operations_per_rank"] == 2 and r["operations_per_rank_max"] == 2
        assert r["server_requests_per_step"] == 0
        assert r["setup_requests"] > 0
    assert eight["stakes"] == 2
    models = {r["layout"]: r for r in rows if r["modelled"]}
    big = models["PP=16 x DP=128 x TP=4"]
    assert big["ranks"] == 16384 and big["stakes"] == 4096
    assert big["server_requests_per_step"] == 0
    assert models["FSDP2 only (no TP)"]["operations_per_rank"] == 0
    assert "stake group ~" in printed and "store req/step" in printed
