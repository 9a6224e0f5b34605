"""`python -m remat_dist report --nproc 2` prints the cross-rank report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from remat_dist.report import CrossRankReport


@pytest.mark.slow
def test_report_cli_two_ranks_uneven(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "remat_dist", "report", "--nproc", "2", "--uneven",
         "--remat", "attention", "--layers", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "saved for backward across 2 ranks" in proc.stdout
    assert "on rank 1" in proc.stdout.splitlines()[0]  # rank 1 has twice the batch
    report = CrossRankReport.from_dict(json.loads(out.read_text()))
    assert report.world_size == 2 and report.totals.max_rank == 1
    for region in report.regions:
        assert region.bytes[1] == 2 * region.bytes[0] > 0
