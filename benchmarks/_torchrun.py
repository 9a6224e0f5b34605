"""Starting the benchmarks' other processes: torchrun ranks and plain ranks.

The distributed benchmarks measure under torchrun's TCPStore, as real jobs run:
each is a module that, started as ``python -m MODULE --torchrun-rank OUT_PATH
CONFIG_JSON`` (:func:`rank_args` reads that), trains on every rank and has rank 0
write its results to ``OUT_PATH`` as JSON; started any other way it is the
benchmark's command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["ROOT", "child_env", "rank_args", "run_worker", "with_root"]

ROOT = Path(__file__).resolve().parents[1]
"""The checkout that holds ``benchmarks/`` (and the ``remat_dist`` it measures)."""

RANK_FLAG = "--torchrun-rank"


def rank_args(argv: list[str]) -> tuple[str, dict[str, Any]] | None:
    """``(OUT_PATH, config)`` where ``argv`` (``sys.argv[1:]``) is a rank's, as
    :func:`run_worker` starts it; None for the command line."""
    if len(argv) == 3 and argv[0] == RANK_FLAG:
        return argv[1], json.loads(argv[2])
    return None


def with_root(**extra: str) -> dict[str, str]:
    """This process's environment plus ``extra``, with the checkout's root first on
    ``PYTHONPATH``: a child started as ``python -m benchmarks.X`` finds it there,
    wherever its working directory, and imports this checkout's ``remat_dist``."""
    env = dict(os.environ, **extra)
    paths = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a rank this process starts: :func:`with_root`, one torch
    thread, gloo on loopback, warnings off unless set, and ``extra``."""
    env = with_root()
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.update(extra)
    return env


def run_worker(module: str, ranks: int, config: dict[str, Any], what: str) -> dict[str, Any]:
    """``python -m torch.distributed.run --standalone --nproc-per-node ranks -m
    module --torchrun-rank OUT CONFIG``, one torch thread per rank; returns what rank 0 wrote to OUT.
    Raises ``RuntimeError`` with the end of stderr, naming ``what``, if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(ranks), "-m", module, RANK_FLAG, path,
            json.dumps(config),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
        if proc.returncode != 0:
            raise RuntimeError(f"{what} failed:\n{proc.stderr[-4000:]}")
        with open(path) as f:
            return json.load(f)
