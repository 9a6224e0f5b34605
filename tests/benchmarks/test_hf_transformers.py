"""``python -m benchmarks.hf_transformers`` runs end to end on a tiny size and
writes its JSON (a smoke test: the figures are measured by running it; here only
what holds on any machine is asserted, bytes, never times)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_bench_transformers_tiny_writes_json(tmp_path, capsys):
    pytest.importorskip("transformers")
    from benchmarks.hf_transformers import main

    out = tmp_path / "bench.json"
    rc = main([
        "--families", "qwen2", "--hidden", "32",
        "--layers", "2", "--seq", "16", "--batch", "2", "--iters", "1",
        "--warmup", "2", "--no-compile", "--json", str(out),
    ])
    assert rc == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == [
        "no AC", "HF checkpointing", "remat full", "remat attention kept",
        "remat budget 25%", "remat budget 50%", "remat budget 75%",
    ]
    saved = {k: r["saved_bytes"] for k, r in rows.items()}
    assert saved["remat full"] <= saved["HF checkpointing"]
    assert saved["remat full"] < saved["remat attention kept"] < saved["no AC"]
    for level in ("25%", "50%", "75%"):
        assert rows[f"remat budget {level}"]["within_budget"], rows[f"remat budget {level}"]
    assert "remat attention kept" in capsys.readouterr().out
