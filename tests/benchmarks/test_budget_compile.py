"""``python -m benchmarks.budget_compile`` end to end (tiny sizes), and what the
budget benchmarks import."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from tests.benchmarks._run import ROOT, run_benchmark

pytestmark = pytest.mark.slow


def test_budget_compile_small(tmp_path):
    """Each compiled MemoryBudget's whole-step peak is within the bytes the
    min-cut variant it is matched with kept (its budget), each plan names every
    block, and every variant has a step time and a ratio within rounds."""
    path = tmp_path / "bc.json"
    proc = run_benchmark("budget_compile", "--models", "gpt", "--layers", "2",
                         "--iters", "2", "--warmup", "2", "--fractions", "0.6",
                         "--json", str(path), timeout=900)
    rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"eager no AC", "compile no AC", "min-cut 0.6",
                         "min-cut 0.6 blocks", "MemoryBudget 0.6",
                         "MemoryBudget 0.6 blocks"}
    for variant, matched in (("MemoryBudget 0.6", "min-cut 0.6"),
                             ("MemoryBudget 0.6 blocks", "min-cut 0.6 blocks")):
        ours = rows[variant]
        assert ours["matched"] == matched
        assert ours["saved_bytes"] <= ours["budget_bytes"] == rows[matched]["saved_bytes"]
        assert ours["within_budget"] and len(ours["decisions"]) == 2
        low, high = ours["x_matched_95"]
        assert low <= ours["x_matched"] <= high
        assert variant in proc.stdout
    assert all(r["time_ms"] > 0 and r["x_compile_no_ac"] > 0 for r in rows.values())


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
    return names


def test_benchmarks_import_no_test_helper_and_budget_ones_no_private_module():
    """No benchmark imports from ``tests``; the budget benchmarks use only
    remat_dist's public modules (a user can run what they show)."""
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        bad = [m for m in _imports(path) if m == "tests" or m.startswith("tests.")]
        assert not bad, (path.name, bad)
    for name in ("budget.py", "budget_compile.py", "budget_pipeline.py"):
        private = [m for m in _imports(ROOT / "benchmarks" / name)
                   if m.startswith("remat_dist") and any(p.startswith("_") for p in m.split("."))]
        assert not private, (name, private)
