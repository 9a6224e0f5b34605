"""torch's internals stay behind one seam: ``remat_dist/_torch``.

* No module outside ``remat_dist/_torch`` references a private torch piece: an
  attribute chain or import from ``torch`` with a ``_private`` part (read from the
  AST, through the names each module binds to torch), a private module path in a
  string, or one of torch's private instance attributes that remat_dist uses.
* Every private piece ``remat_dist/_torch`` reaches is listed in its ``REQUIRED``,
  which importing remat_dist checks against the installed torch: a missing piece
  raises ImportError naming it and the supported versions.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "remat_dist"
SEAM = PACKAGE / "_torch"

# Private attributes of torch objects (modules, tensors, nodes, ops) that remat_dist
# reads or patches: only the seam may name them, as attributes or as strings.
INSTANCE_PRIVATES = {
    "_buffers",
    "_call_impl",
    "_compiled_call_impl",
    "_wrapped_call_impl",
    "_execution_engine",
    "_handle",
    "_is_view",
    "_make_wrapper_subclass",
    "_free_weak_ref",
    "_weak_ref",
    "_sequence_nr",
    "_neg_view",
    "_disabled_torch_function_impl",
}
# Tensor and storage attributes left in place (every layer reads them; see
# docs/architecture.md, "torch's internals"): a version counter, a view's base, a
# storage's identity.
ALLOWED_TENSOR_ATTRS = {"_version", "_base", "_cdata"}
# As strings only the attributes remat_dist patches or reads by name are looked for
# (a list of TensorBase method names to forward, such as "_is_view", is no access).
STRING_PRIVATES = {
    "_buffers",
    "_call_impl",
    "_compiled_call_impl",
    "_wrapped_call_impl",
}

_PRIVATE_STRING = re.compile(r"^(torch\.[\w.]*\._\w*|_raw_saved_\w*)$")


def _private(parts: list[str]) -> bool:
    return any(
        p.startswith("_") and not (p.startswith("__") and p.endswith("__"))
        for p in parts[1:]
    )


def private_references(path: Path) -> list[tuple[int, str]]:
    """``(line, what)`` for every private torch piece ``path`` references."""
    tree = ast.parse(path.read_text())
    bound: dict[str, str] = {}  # local name -> the torch path it stands for
    hits: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "torch":
                    continue
                if _private(a.name.split(".")):
                    hits.append((node.lineno, f"import {a.name}"))
                bound[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "torch":
                continue
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if _private(full.split(".")):
                    hits.append((node.lineno, f"from {node.module} import {a.name}"))
                bound[a.asname or a.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                full = bound[base.id].split(".") + chain[::-1]
                if _private(full):
                    hits.append((node.lineno, ".".join(full)))
            if node.attr in INSTANCE_PRIVATES:
                hits.append((node.lineno, f"<object>.{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in STRING_PRIVATES or _PRIVATE_STRING.match(node.value):
                hits.append((node.lineno, repr(node.value)))
    return sorted(set(hits))


def _outside_seam() -> list[Path]:
    return sorted(
        p
        for p in PACKAGE.rglob("*.py")
        if SEAM not in p.parents and "__pycache__" not in p.parts
    )


def test_no_private_torch_reference_outside_the_seam():
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in _outside_seam()
        for line, what in private_references(path)
    ]
    assert not found, (
        "private torch pieces used outside remat_dist/_torch (add a named function "
        "or constant to the module of its concern there, list the piece in "
        "remat_dist/_torch/__init__.py's REQUIRED, and import it):\n" + "\n".join(found)
    )


def test_the_scan_sees_private_references(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\n"
        "import torch.utils.checkpoint as tc\n"
        "from torch.utils._pytree import tree_leaves\n"
        "from torch import _C\n"
        "a = torch._C._current_graph_task_id()\n"
        "b = tc._StopRecomputationError\n"
        "c = torch.autograd.Variable._execution_engine\n"
        "m.__dict__['_call_impl'] = f\n"
        "d = torch.nn.Linear(1, 1).weight.shape\n"
        "e = t._version\n"
    )
    found = {what for _, what in private_references(sample)}
    assert {
        "from torch.utils._pytree import tree_leaves",
        "from torch import _C",
        "torch._C._current_graph_task_id",
        "torch.utils.checkpoint._StopRecomputationError",
        "<object>._execution_engine",
        "'_call_impl'",
    } <= found
    assert not any("Linear" in w or "_version" in w for w in found)


def test_the_seam_lists_every_private_piece_it_uses():
    from remat_dist._torch import _CORE, _CUDA_BUILD, _DISTRIBUTED

    listed = set(_CORE) | set(_DISTRIBUTED) | set(_CUDA_BUILD)
    unlisted = []
    for path in sorted(SEAM.glob("*.py")):
        for line, what in private_references(path):
            if what.startswith("<object>.") or what.startswith("'"):
                continue  # instance attributes: named in the module's docstrings
            dotted = (
                what.split(" import ")[0].removeprefix("from ").removeprefix("import ")
            )
            if " import " in what:
                dotted = f"{dotted}.{what.split(' import ')[1]}"
            parts = [p for p in dotted.split(".") if not p.startswith("__")]
            dotted = ".".join(parts)
            if not any(
                r == dotted or r.startswith(dotted + ".") or dotted.startswith(r + ".")
                for r in listed
            ):
                unlisted.append(f"{path.name}:{line}: {dotted}")
    assert not unlisted, "add to remat_dist/_torch REQUIRED:\n" + "\n".join(unlisted)


def test_the_installed_torch_has_every_piece():
    from remat_dist._torch import REQUIRED, missing_pieces

    assert len(REQUIRED) > 40
    assert missing_pieces() == []


def _import_without(owner: str, attribute: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import importlib, torch, torch.distributed\n"
        f"owner = importlib.import_module({owner!r}) if '.' in {owner!r} and "
        f"{owner!r}.split('.')[-1][0].islower() else None\n"
        f"if owner is None:\n"
        f"    mod, cls = {owner!r}.rsplit('.', 1)\n"
        f"    owner = getattr(importlib.import_module(mod), cls)\n"
        f"delattr(owner, {attribute!r})\n"
        "import remat_dist\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True
    )


@pytest.mark.slow
def test_import_fails_naming_a_missing_private_piece():
    from remat_dist._torch import SUPPORTED_TORCH

    proc = _import_without("torch._C", "_current_graph_task_id")
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr, proc.stderr
    assert "torch._C._current_graph_task_id" in proc.stderr, proc.stderr
    assert SUPPORTED_TORCH in proc.stderr, proc.stderr


@pytest.mark.slow
def test_import_fails_naming_a_missing_fsdp_method():
    owner = "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup"
    proc = _import_without(owner, "post_backward")
    assert proc.returncode != 0
    assert f"{owner}.post_backward" in proc.stderr, proc.stderr
    assert "ImportError" in proc.stderr, proc.stderr


def test_pyproject_claims_the_supported_range():
    from remat_dist._torch import SUPPORTED_TORCH

    toml = (ROOT / "pyproject.toml").read_text()
    assert f'"torch{SUPPORTED_TORCH}"' in toml


def test_docs_and_ci_name_every_tested_release():
    from remat_dist._torch import SUPPORTED_TORCH, TESTED_TORCH

    page = (ROOT / "docs" / "torch_versions.md").read_text()
    assert f"torch{SUPPORTED_TORCH}" in page
    assert [v for v in TESTED_TORCH if v not in page] == []
    # the matrix reads its releases from TESTED_TORCH; CI runs it
    assert "TESTED_TORCH" in (ROOT / "scripts" / "test_torch_matrix.sh").read_text()
    assert "scripts/test_torch_matrix.sh" in (ROOT / ".ci" / "run").read_text()
