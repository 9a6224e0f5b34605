"""The README's install command for a user's project works from a checkout and
writes nothing into it (no ``build/``, no ``*.egg-info``): pip builds a clone of
the committed tree in a temporary folder."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _build_outputs() -> dict[str, int]:
    """What an in-place build leaves in the checkout, with when it was written
    (an editable install made for the test suite may have left one already)."""
    found = {}
    for path in (ROOT / "build", *ROOT.glob("*.egg-info")):
        if path.exists():
            found[path.name] = max(
                p.stat().st_mtime_ns for p in (path, *path.rglob("*"))
            )
    return found


def test_the_readme_installs_from_git_file():
    readme = (ROOT / "README.md").read_text()
    assert 'pip install "git+file:///path/to/remat_dist"' in readme
    assert re.search(r"Python 3\.10 or later and torch 2\.11 through 2\.15", readme)


@pytest.mark.slow
def test_install_from_the_checkout_writes_nothing_into_it(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    before = _build_outputs()
    target = tmp_path / "site"
    proc = subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
            "--no-build-isolation", "--target", str(target), f"git+file://{ROOT}",
        ],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (target / "remat_dist" / "__init__.py").is_file()
    assert (target / "remat_dist_torch_remat.pth").is_file()
    assert _build_outputs() == before, "the install wrote build outputs into the checkout"
