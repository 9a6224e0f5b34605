"""Every repository path that README.md and docs/ cite exists (and a cited test,
``path::name``, is defined in that file): a moved or deleted file cannot leave a
sentence behind that sends a reader nowhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PREFIXES = (
    "remat_dist/",
    "tests/",
    "scripts/",
    "docs/",
    "launchers/",
    "benchmarks/",
    "constraints/",
    ".ci/",
)
_PATH = re.compile(
    r"(?<![\w/.-])((?:" + "|".join(re.escape(p) for p in PREFIXES) + r")[\w./*-]*)"
    r"(?:::(\w+))?"
)


PENDING: set[str] = set()
"""Pages other people are writing now: cited before they land (empty it when they do)."""

STORE_KEYS = {"remat_dist/g/"}
"""Prefixes of the c10d store's keys the docs name (not files)."""


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _cited(text: str) -> list[tuple[str, str | None]]:
    out = []
    for m in _PATH.finditer(text):
        path = m.group(1).rstrip(".,;:)")
        if "*" in path or path.endswith("/...") or path in STORE_KEYS | PENDING:
            continue
        out.append((path, m.group(2)))
    return out


def test_every_cited_path_exists():
    missing = []
    for doc in _documents():
        for path, name in _cited(doc.read_text()):
            target = ROOT / path
            if not target.exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
            elif name is not None and target.is_file():
                if not re.search(rf"\bdef {re.escape(name)}\b", target.read_text()):
                    missing.append(f"{doc.relative_to(ROOT)}: {path}::{name}")
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def test_the_check_finds_paths():
    # the pattern itself: a sentence's paths, with and without a test name
    got = _cited("see `tests/docs/test_paths.py::test_every_cited_path_exists`, and docs/api.md.")
    assert got == [
        ("tests/docs/test_paths.py", "test_every_cited_path_exists"),
        ("docs/api.md", None),
    ]
