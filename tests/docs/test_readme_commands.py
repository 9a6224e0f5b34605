"""The README's commands and environment variables hold: every ``scripts/demo.sh``
command line it shows is accepted by the launcher it runs (the same argument
parser, so a renamed flag fails here), every ``REMAT_DIST_*`` variable it names is
read by the package and exercised by a test, and every script and module it tells
you to run exists and is one. The demo itself runs in CI (``.ci/run``), the suite
through ``scripts/test.sh``."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _demo_commands() -> list[list[str]]:
    out = []
    for m in re.finditer(r"scripts/demo\.sh((?: --?[\w-]+(?: (?!#)[\w.]+)?)*)", README):
        out.append(shlex.split(m.group(1)))
    return out


def test_every_demo_command_line_parses():
    commands = _demo_commands()
    flags = {a for c in commands for a in c if a.startswith("--")}
    assert {"--steps", "--remat", "--compile", "--memory-budget"} <= flags, commands
    sys.path.insert(0, str(ROOT / "launchers"))
    spec = importlib.util.spec_from_file_location("_readme_train", ROOT / "launchers" / "train.py")
    train = sys.modules["_readme_train"] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(train)
        for argv in commands:
            train.parse_args(argv)  # argparse exits (SystemExit) on an unknown flag
    finally:
        sys.path.remove(str(ROOT / "launchers"))
        sys.modules.pop("_readme_train", None)


def test_every_environment_variable_is_read_and_tested():
    names = set(re.findall(r"\bREMAT_DIST_[A-Z_]+\b", README))
    assert "REMAT_DIST_LOG" in names
    code = "\n".join(p.read_text() for p in (ROOT / "remat_dist").rglob("*.py"))
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    for name in sorted(names):
        assert name in code, f"README names {name}; the package never reads it"
        assert tests.count(name) >= 2, f"README names {name}; no test sets it"


def test_every_script_and_module_it_runs_exists():
    for script in set(re.findall(r"\bscripts/[\w.]+\.sh\b", README)):
        path = ROOT / script
        assert path.is_file() and path.stat().st_mode & 0o111, script
    for module in set(re.findall(r"python -m ([\w.]+)", README)):
        assert importlib.util.find_spec(module) is not None, module
        if module.startswith("remat_dist"):
            assert importlib.util.find_spec(f"{module}.__main__") is not None, module
