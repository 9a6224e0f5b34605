"""Run a benchmark worker module on local CPU ranks under ``torchrun``.

The distributed benchmarks measure under torchrun's TCPStore, as real jobs run:
each is a module whose ``__main__`` takes ``OUT_PATH CONFIG_JSON``, trains on every
rank and has rank 0 write its results to ``OUT_PATH`` as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

__all__ = ["run_worker"]


def run_worker(module: str, ranks: int, config: dict[str, Any], what: str) -> dict[str, Any]:
    """``python -m torch.distributed.run --standalone --nproc-per-node ranks -m
    module OUT CONFIG``, one torch thread per rank; returns what rank 0 wrote to OUT.
    Raises ``RuntimeError`` with the end of stderr, naming ``what``, if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        env = dict(
            os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1"
        )
        env.setdefault("PYTHONWARNINGS", "ignore")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(ranks), "-m", module, path, json.dumps(config),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{what} failed:\n{proc.stderr[-4000:]}")
        with open(path) as f:
            return json.load(f)
