"""Running a benchmark as a user runs it: ``python -m benchmarks.NAME`` from the
root of the checkout (the tests of this folder are the slow tier; the fast tier
never imports ``benchmarks``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(name: str, *args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.<name> args`` in the checkout's root, with that root
    first on ``PYTHONPATH`` (its ``remat_dist``, whatever is installed); asserts
    it exits 0 and returns the process."""
    env: dict[str, Any] = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc
