"""``launchers/train.py --compile``: blocks compiled one by one after remat, on 2
CPU ranks under torchrun (inductor); the refusal of ``--memory-budget`` with it."""

from __future__ import annotations

import sys

import pytest

from tests.launchers.test_train import TRAIN, torchrun


def _launcher():
    sys.path.insert(0, str(TRAIN.parent))
    try:
        import train
    finally:
        sys.path.remove(str(TRAIN.parent))
    return train


@pytest.mark.slow
def test_compile_flag_trains():
    proc = torchrun(
        "--steps", "3", "--dim", "32", "--layers", "1", "--seq", "16", "--heads", "2",
        "--remat", "attention", "--compile", timeout=240,
    )
    tail = f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-2000:]}"
    assert proc.returncode == 0, tail
    steps = [line for line in proc.stdout.splitlines() if " loss " in line]
    assert len(steps) == 3, tail
    losses = [float(line.split(" loss ")[1].split()[0]) for line in steps]
    assert losses[-1] < losses[0], losses


def test_compile_with_memory_budget_is_accepted():
    """--compile with --memory-budget: the budget compiles each block once its
    plan is made (MemoryBudget(compile=...))."""
    train = _launcher()
    cfg = train.parse_args(["--compile", "--memory-budget", "1MiB"])
    assert cfg.compile
    train.validate(cfg, 2)
