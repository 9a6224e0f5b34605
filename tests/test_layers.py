"""The layer picture holds: imports point down, and core's privates stay in core.

core <- distributed <- report, and distributed <- wrap <- budget, shard; cli and
launchers above all; testing, models and integrations sit at the side (they may
use the library layers; no library layer imports them). The package root
``remat_dist/__init__.py`` is the composition root that imports all.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "remat_dist"

# What each library layer may import from remat_dist (besides itself, _errors, _logging
# _torch, the seam to torch's internals, and _state, the process-state registry).
LIBRARY = {"core", "distributed", "report", "wrap", "budget", "shard"}
ALLOWED = {
    "core": set(),
    "distributed": {"core"},
    "report": {"core", "distributed"},
    "wrap": {"core", "distributed"},
    "budget": {"core", "distributed", "wrap"},
    "shard": {"core", "distributed", "wrap"},
    "cli": LIBRARY | {"integrations", "testing", "models", "(root)"},
    "testing": LIBRARY | {"models"},
    "models": LIBRARY,
    "integrations": LIBRARY,
}


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
            out.extend(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return [m for m in out if m == "remat_dist" or m.startswith("remat_dist.")]


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(root)"


def test_imports_point_down():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) == 1:
            continue  # the composition root and _errors.py
        layer = rel.parts[0]
        if layer == "_torch":
            continue  # test_the_torch_seam_imports_only_errors
        for module in _imports(path):
            target = _layer(module)
            if target in (layer, "_errors", "_logging", "_torch", "_state"):
                continue
            if target not in ALLOWED[layer]:
                wrong.append(f"{rel}: {layer} -> {module}")
    assert not wrong, "imports pointing the wrong way:\n" + "\n".join(
        sorted(set(wrong))
    )


def test_the_torch_seam_imports_only_errors():
    # remat_dist/_torch sits below every layer: it may use the error types only
    wrong = [
        f"{path.relative_to(PACKAGE)}: {module}"
        for path in (PACKAGE / "_torch").rglob("*.py")
        for module in _imports(path)
        if _layer(module) not in ("_torch", "_errors")
    ]
    assert not wrong, "remat_dist/_torch imports more than _errors:\n" + "\n".join(
        wrong
    )


def test_core_privates_stay_in_core():
    private = {f"remat_dist.core.{p.stem}" for p in (PACKAGE / "core").glob("_*.py")}
    private.discard("remat_dist.core.__init__")
    leaks = []
    for base in (PACKAGE, ROOT / "launchers", ROOT / "scripts"):
        for path in base.rglob("*.py"):
            if (PACKAGE / "core") in path.parents:
                continue
            for module in _imports(path):
                if any(module == p or module.startswith(p + ".") for p in private):
                    leaks.append(f"{path.relative_to(ROOT)}: {module}")
    assert not leaks, "use remat_dist.core's front door:\n" + "\n".join(
        sorted(set(leaks))
    )
    # and the lint rule names every one of them, so ruff catches the next one
    toml = (ROOT / "pyproject.toml").read_text()
    missing = sorted(p for p in private if f'"{p}".msg' not in toml)
    assert not missing, (
        f"add to [tool.ruff.lint.flake8-tidy-imports.banned-api]: {missing}"
    )


def test_ruff_passes_with_the_layer_rule():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which(
        "ruff"
    )
    if ruff is None:  # an environment without the test extra (CI's plain one)
        pytest.skip(
            "ruff is not installed: it comes with the test extra (pip install -e '.[test]')"
        )
    proc = subprocess.run(
        [ruff, "check", "remat_dist", "launchers", "scripts", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_importing_core_modules_installs_nothing():
    # core's modules register no observer and no provider by themselves: the
    # composition root (remat_dist/__init__.py) attaches the distributed layer.
    code = (
        "import sys, importlib\n"
        "import remat_dist.core._record as r\n"
        "assert 'remat_dist.distributed' in sys.modules  # the root imported it\n"
        "names = [o.__class__.__module__ for o in r._SEAMS.observers]\n"
        "assert all(not n.startswith('remat_dist.core') for n in names), names\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def _private_references(path: Path) -> list[str]:
    """``remat_dist.<x>.<name>`` modules and names ``path`` reaches: its imports, and
    attribute chains such as ``remat_dist.distributed._step.current_step`` (which
    work once some other module imported the private one)."""
    out = _imports(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            text = ast.unparse(node)
            if text.startswith("remat_dist."):
                out.append(text)
    return out


def _private_imports_across_layers() -> set[tuple[str, str]]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel == Path("__init__.py"):
            continue  # the composition root
        layer = rel.parts[0] if len(rel.parts) > 1 else "(root)"
        for module in _private_references(path):
            parts = module.split(".")
            if len(parts) < 3 or parts[1] in (layer, "_torch", "_errors", "_logging", "_state"):
                continue
            if parts[2].startswith("_"):
                found.add((str(rel), ".".join(parts[:3])))
    return found


def test_layers_use_each_others_public_interfaces_only():
    # no remat_dist.<layer>._* from another layer, nor from the package's other
    # top-level modules (compat.py, errors.py, ...): only the composition root
    # (remat_dist/__init__.py) and the shared private modules (_torch, _errors,
    # _logging, _state) are exempt
    found = sorted(_private_imports_across_layers())
    assert not found, (
        "a layer imports another layer's private module; use that layer's front "
        "door (its package's __init__) instead:\n"
        + "\n".join(f"{f}: {m}" for f, m in found)
    )
