"""The shipped command line keeps what a user runs on their own job; remat_dist's
benchmarks live beside the package (``benchmarks/``), which never imports them.
Fast tier: nothing here imports ``benchmarks``."""

from __future__ import annotations

import ast
from pathlib import Path

from remat_dist.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_report_only(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "report" in out and "bench" not in out


def test_bench_says_where_the_benchmarks_live(capsys):
    assert main(["bench", "--scale"]) == 2
    err = capsys.readouterr().err
    assert "benchmarks/" in err and "python -m benchmarks.core" in err
    assert "python -m benchmarks.scale" in err and "docs/benchmarks.md" in err


def test_the_package_never_imports_the_benchmarks():
    found = []
    for path in sorted((ROOT / "remat_dist").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found += [
                f"{path.relative_to(ROOT)}: {n}"
                for n in names
                if n == "benchmarks" or n.startswith("benchmarks.")
            ]
    assert not found, found


def test_the_wheel_packages_remat_dist_only():
    # setuptools' package discovery (pyproject.toml) is what keeps benchmarks/ out
    # of the wheel; building one is the slow check (tests/benchmarks)
    toml = (ROOT / "pyproject.toml").read_text()
    assert 'include = ["remat_dist*"]' in toml
