"""``python -m benchmarks.transport`` on a tiny configuration (2 ranks, few rounds):
the JSON holds every row, and a stake's round stays within a loose bound of a
plain gloo ``all_reduce`` (3x: only a broken transport fails it; the figures
themselves are measured by running the benchmark, docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.benchmarks._run import ROOT, run_benchmark

pytestmark = pytest.mark.slow


def _has_old_channel() -> bool:
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e",
         "4de3215:remat_dist/distributed/_channel.py"],
        capture_output=True,
    )
    return proc.returncode == 0


def test_transport_tiny_writes_every_row(tmp_path):
    out = tmp_path / "transport.json"
    proc = run_benchmark(
        "transport", "--ranks", "1", "2", "--rounds", "20", "--samples", "3",
        "--warmup", "5", "--json", str(out),
    )
    data = json.loads(out.read_text())
    old = _has_old_channel()
    designs = {"stake group", "plain gloo"} | ({"old side channel"} if old else set())
    if old:
        assert data["old_side_channel"] == "measured"
    else:  # no git history here: (c) is skipped with a line saying why
        assert data["old_side_channel"].startswith("skipped")
    assert [r["ranks"] for r in data["rows"]] == [1, 2]
    for row in data["rows"]:
        assert set(row["designs"]) == designs
        for d in row["designs"].values():
            lo, hi = d["round_ms_ci95"]
            assert len(d["samples_ms"]) == 3 and lo <= d["round_ms"] <= hi
        assert set(row["ratios"]) == {"stake/plain"} | ({"stake/old"} if old else set())
    # a healthy round is one gloo operation and no store request
    two = data["rows"][1]
    assert two["designs"]["stake group"]["store_requests"] == 0
    assert two["ratios"]["stake/plain"]["median"] <= 3.0, two["ratios"]
    # the model: a fixed cost and a hop per design, every rank count, the
    # 16,384-rank layouts (a TP stake of 2, 4, 8 ranks) and FSDP2 without a stake
    model = data["model"]
    assert set(model["hop_ms"]) == designs
    assert {(r["ranks"], r["design"]) for r in model["rounds"]} == {
        (n, d) for n in (1, 2) for d in designs
    }
    layouts = {r["layout"] for r in model["world"]}
    assert {"PP=16 x DP=128 x TP=8", "FSDP2 only (no TP)"} <= layouts
    big = next(r for r in model["world"] if r["layout"] == "PP=16 x DP=128 x TP=8"
               and r["design"] == "stake group")
    assert big["stakes"] == 2048 and big["step_ms_measured"] is None
    assert "(a)/(b)" in proc.stdout and "16,384 ranks" in proc.stdout
