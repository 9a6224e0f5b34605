"""``python -m remat_dist bench --scale`` on a tiny configuration: the side channel
of a stake of 2 and of 4 simulated ranks, and the previous design's world store
rounds on 4, each run for real; the modelled rows at 16,384 ranks follow."""

from __future__ import annotations

import json

import pytest

from remat_dist.cli.bench_scale import ROW_KEYS
from remat_dist.cli.main import main


@pytest.mark.slow
def test_bench_scale_tiny(tmp_path, capsys):
    out = tmp_path / "scale.json"
    rc = main(
        ["bench", "--scale", "--ranks", "2", "8", "--group", "4", "--store-ranks", "4",
         "--steps", "3", "--workers", "2", "--timeout", "20", "--json", str(out)]
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
        ("side channel", 2, 2), ("side channel", 8, 4), ("world store", 4, 4)
    ]
    two, eight, store = run
    # recursive doubling: a round among 2 ranks is 1 message per rank, among 4 it
    # is 2; two rounds per step; the store sees nothing once the links are made
    assert two["messages_per_rank"] == 2 and two["messages_per_rank_max"] == 2
    assert eight["messages_per_rank"] == 4 and eight["stakes"] == 2
    for r in (two, eight):
        assert r["server_requests_per_step"] == 0
        assert r["setup_requests"] > 0
    # the previous design: every rank talks to the one server, 8 requests a step
    # (and a few more for the rank that judges a round)
    assert 8 * 4 <= store["server_requests_per_step"] <= 8 * 4 + 8
    models = {r["layout"]: r for r in rows if r["modelled"]}
    big = models["PP=16 x DP=128 x TP=4"]
    assert big["ranks"] == 16384 and big["stakes"] == 4096
    assert big["server_requests_per_step"] == 0
    assert models["FSDP2 only (no TP)"]["messages_per_rank"] == 0
    assert models["world"]["server_requests_per_step"] >= 8 * 16384
    assert "side channel ~" in printed and "store req/step" in printed
