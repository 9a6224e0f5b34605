"""The layout holds what docs/architecture.md says of it: every module is named
there (each module one concern, whatever its length), no package imports itself
in a circle, and every
public name is published once (the user API at ``remat_dist``, each layer's own
interface in its package)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "remat_dist"


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_architecture_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = [
        str(p.relative_to(PACKAGE))
        for p in _modules()
        if str(p.relative_to(PACKAGE)) not in text
    ]
    assert not missing, (
        "docs/architecture.md does not name these modules (write each as its path "
        "under remat_dist/, e.g. `wrap/_install.py`):\n" + "\n".join(missing)
    )


def _runtime_imports(path: Path) -> set[str]:
    """The remat_dist modules ``path`` imports when it runs (module level and in
    functions; ``if TYPE_CHECKING:`` blocks left out)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if base.startswith("remat_dist"):
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("remat_dist"))
    return out


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_no_import_circle_inside_a_package():
    names = {_module_name(p): p for p in _modules()}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        pkg = name.rsplit(".", 1)[0] if not path.name == "__init__.py" else name
        deps = set()
        for target in _runtime_imports(path):
            while target and target not in names:
                target = target.rsplit(".", 1)[0] if "." in target else ""
            # edges between modules of one package only (front doors left out:
            # a package's __init__ re-exports its modules by design)
            if (
                target
                and target != name
                and not names[target].name == "__init__.py"
                and target.rsplit(".", 1)[0] == pkg
            ):
                deps.add(target)
        graph[name] = deps
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _public_modules() -> list[str]:
    out = []
    for path in _modules():
        name = _module_name(path)
        if any(part.startswith("_") for part in name.split(".")[1:]):
            continue
        if name.startswith(("remat_dist.cli", "remat_dist.__main__")):
            continue
        out.append(name)
    return out


def test_every_public_name_is_published_once():
    owners: dict[str, list[str]] = {}
    for name in _public_modules():
        module = importlib.import_module(name)
        for public in getattr(module, "__all__", ()):
            owners.setdefault(public, []).append(name)
    twice = {k: v for k, v in owners.items() if len(v) > 1}
    assert not twice, f"published by more than one module: {twice}"


def test_the_user_front_door_is_the_documented_api():
    import remat_dist

    api = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^#{3,4} `(\w+)`$", api, flags=re.M))
    assert set(remat_dist.__all__) == documented
    assert len(remat_dist.__all__) == len(set(remat_dist.__all__))


def test_the_extension_interface_is_documented():
    import remat_dist.core

    text = (ROOT / "docs" / "extending.md").read_text()
    missing = [n for n in remat_dist.core.__all__ if f"`{n}" not in text]
    assert not missing, f"docs/extending.md does not document: {missing}"


TORCH_REMAT_0_2 = {
    "checkpoint", "region", "recompute_needs_tensor", "save_for_backward",
    "is_recomputing", "is_placeholder", "RecomputeStateHook", "saved_tensors_hooks",
    "current_saved_tensor_info", "SavedTensorInfo", "SavedTensorKind",
    "collect_trace", "trace_scope", "format_saved_tensors_report",
    "print_saved_tensors_report", "format_current_memory_report",
    "print_current_memory_report", "discover_autograd_roots", "oom_observer",
    "format_oom_saved_tensors_report", "memory_snapshot_annotate",
    "clear_memory_snapshot_cache",
}
"""torch_remat 0.2's top-level names (its ``__init__.py``)."""


def test_the_top_level_is_torch_remats_names_and_at_most_15_of_our_own():
    import remat_dist

    names = set(remat_dist.__all__)
    assert TORCH_REMAT_0_2 <= names, sorted(TORCH_REMAT_0_2 - names)
    assert remat_dist.TORCH_REMAT_NAMES == TORCH_REMAT_0_2
    own = names - TORCH_REMAT_0_2
    assert len(own) <= 15, sorted(own)


def test_a_moved_name_still_works_and_warns_with_its_new_home():
    import warnings

    import remat_dist

    for name, target in remat_dist.MOVED.items():
        assert name not in remat_dist.__all__
        module, new = target.rsplit(".", 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old = getattr(remat_dist, name)
        assert old is getattr(importlib.import_module(module), new), name
        assert len(caught) == 1 and caught[0].category is DeprecationWarning, name
        assert target in str(caught[0].message), caught[0].message
        assert caught[0].filename == __file__  # points at the caller's line
    try:
        remat_dist.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("remat_dist.no_such_name did not raise AttributeError")
