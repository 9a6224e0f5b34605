"""The benchmark runs end to end on a tiny size and writes its JSON (a smoke test:
the figures themselves are measured by running it, not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_tiny_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "remat_dist", "bench", "--dims", "32", "--seq", "16",
         "--batch", "2", "--layers", "2", "--heads", "4", "--iters", "2", "--warmup", "1",
         "--steady-steps", "5", "--dist", "2", "--dist-iters", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    by_variant = {r["variant"]: r for r in data["rows"]}
    # all-recompute keeps exactly what torch.utils.checkpoint keeps
    assert by_variant["remat_dist full"]["saved_bytes"] == by_variant["torch.utils.checkpoint"]["saved_bytes"]
    assert data["steady_state"]["flat"]
    tp = data["distributed"]["layouts"]["tp"]
    # comm-free replay issues the no-checkpoint backward collectives, no more
    assert sum(tp["remat save"]["backward"].values()) == sum(tp["none"]["backward"].values())
    assert "x torch" in proc.stdout and "distributed (2 gloo ranks" in proc.stdout
