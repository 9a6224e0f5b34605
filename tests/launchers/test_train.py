"""launchers/train.py under torchrun: 2 CPU ranks, loss falls, report JSON, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "launchers" / "train.py"


def torchrun(*args: str, timeout: float = 180, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    env["PYTHONWARNINGS"] = "ignore"
    env.update(env_vars)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", "2", str(TRAIN), *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.slow
def test_two_ranks_train_loss_falls_and_report_json(tmp_path):
    out = tmp_path / "report.json"
    proc = torchrun(
        "--steps", "8", "--dim", "64", "--layers", "2", "--seq", "32",
        "--remat", "attention", "--report-json", str(out), REMAT_DIST_LOG="info",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tail = f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-2000:]}"
    # REMAT_DIST_LOG=info (the README's command): what each rank set up, once
    for rank in (0, 1):
        assert proc.stderr.count(f"[rank {rank}] apply_remat(GPT): 2 of 2 selected blocks") == 1, tail
        said = f"[rank {rank}] 2 checkpoint(s) replayed in this backward in no replay group"
        assert proc.stderr.count(said) == 1, tail
    steps = [line for line in proc.stdout.splitlines() if " loss " in line]
    assert len(steps) == 8 and all(line.startswith("[rank 0]") for line in steps), tail
    losses = [float(line.split(" loss ")[1].split()[0]) for line in steps]
    assert losses[-1] < losses[0] - 0.3, losses
    assert "saved for backward across 2 ranks" in proc.stdout, tail
    data = json.loads(out.read_text())
    ranks = data["saved_tensors"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["total_bytes"] > 0 for r in ranks)
    assert [r["name"] for r in data["saved_tensors"]["regions"]] == ["layers.0", "layers.1"]
    assert len(data["peak_memory_bytes"]) == 2 and data["losses"] == pytest.approx(losses, abs=1e-4)


@pytest.mark.slow
def test_impossible_mesh_fails_on_every_rank_without_hang():
    proc = torchrun("--tp", "3", timeout=120)
    assert proc.returncode != 0
    # Each rank checks before any collective and exits 2; torchrun stops the
    # others as soon as one exits, so a slower rank may be gone before it prints.
    said = [
        rank
        for rank in (0, 1)
        if f"[rank {rank}] train.py: error: --tp 3 does not divide the world size 2"
        in proc.stderr
    ]
    assert said, proc.stderr[-2000:]


def test_bad_flag_and_missing_gpu_and_bare_python(monkeypatch, capsys):
    sys.path.insert(0, str(TRAIN.parent))
    try:
        import train
    finally:
        sys.path.remove(str(TRAIN.parent))
    with pytest.raises(SystemExit) as ei:
        train.parse_args(["--remat", "bogus"])
    assert ei.value.code == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    if not train.torch.cuda.is_available():
        assert train.main(["--device", "cuda"]) == 2
        assert "[rank 1] train.py: error: --device cuda" in capsys.readouterr().err
    assert train.main(["--heads", "3"]) == 2
    assert "--heads 3 must divide --dim 128" in capsys.readouterr().err
    monkeypatch.delenv("RANK")
    assert train.main([]) == 2
    assert "run it with torchrun" in capsys.readouterr().err


@pytest.mark.slow
def test_memory_budget_flag(tmp_path, monkeypatch, capsys):
    out = tmp_path / "report.json"
    proc = torchrun(
        "--steps", "3", "--dim", "64", "--layers", "2", "--seq", "32",
        "--memory-budget", "1MiB", "--report-json", str(out),
    )
    tail = f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-2000:]}"
    assert proc.returncode == 0, tail
    assert "[rank 0] memory budget plan (from step 2): budget 1.00 MiB" in proc.stdout, tail
    plan = json.loads(out.read_text())["memory_budget_plan"]
    assert plan["budget"] == 2**20 and plan["world_size"] == 2
    assert plan["predicted_bytes"] <= 2**20
    assert [b["name"] for b in plan["blocks"]] == ["layers.0", "layers.1"]
    assert {"full", "none"} < set(plan["blocks"][0]["candidates"])
    sys.path.insert(0, str(TRAIN.parent))
    try:
        import train
    finally:
        sys.path.remove(str(TRAIN.parent))
    assert train.parse_args(["--memory-budget", "1.5GiB"]).memory_budget == "1.5GiB"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.main(["--memory-budget", "lots"]) == 2
    assert "--memory-budget: remat_dist.MemoryBudget(bytes=...): cannot read 'lots'" in (
        capsys.readouterr().err
    )
