"""The quick starts in examples/ run as a user runs them: the single-process one
with python, the others under torchrun on CPU ranks (gloo), and the README shows
the FSDP2 x TP one and its model exactly as they are in examples/."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

RANKS = {
    "quickstart_single.py": 0,  # plain python
    "quickstart_fsdp2.py": 2,
    "quickstart_tp.py": 2,
    "quickstart_fsdp2_tp.py": 4,  # dp=2 x tp=2
    "quickstart_pipeline.py": 2,
    "quickstart_transformers.py": 2,
}
"""Each quick start and the ranks it runs on (0: a single process)."""

README_FILES = ("model.py", "quickstart_fsdp2_tp.py")
"""The files the README shows in full, in this order."""


def test_every_quick_start_is_run_here():
    assert {p.name for p in EXAMPLES.glob("quickstart_*.py")} == set(RANKS)


def _readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)


def test_the_readme_shows_the_fsdp2_tp_quick_start_as_it_is():
    blocks = _readme_python_blocks()
    for name in README_FILES:
        content = (EXAMPLES / name).read_text()
        assert content in blocks, (
            f"README.md does not show examples/{name} as it is: copy the file into "
            "its ```python block"
        )


def _run(name: str, timeout: float = 420) -> subprocess.CompletedProcess:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    script = str(EXAMPLES / name)
    ranks = RANKS[name]
    if ranks == 0:
        cmd = [sys.executable, script]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(ranks), script,
        ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RANKS))
def test_quick_start_runs(name):
    if name == "quickstart_transformers.py" and importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install transformers)")
    proc = _run(name)
    tail = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, tail
    assert "step 2: loss" in proc.stdout, tail
    assert "DeprecationWarning" not in proc.stderr, tail
    if "budget" in (EXAMPLES / name).read_text().lower() and name != "quickstart_single.py":
        assert "budget " in proc.stdout, tail  # the plan is printed
