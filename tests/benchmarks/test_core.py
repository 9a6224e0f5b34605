"""``benchmarks.core`` (with ``benchmarks.dist``) and the step benchmarks run end to
end on a tiny size and write their JSON (smoke tests: the figures themselves are
measured by running them, not asserted here). Slow tier: every test here imports
``benchmarks`` or starts it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks._run import run_benchmark

pytestmark = pytest.mark.slow


def test_bench_tiny_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_benchmark(
        "core", "--dims", "32", "--seq", "16", "--batch", "2", "--layers", "2",
        "--heads", "4", "--iters", "2", "--warmup", "1", "--steady-steps", "5",
        "--dist", "2", "--dist-iters", "1", "--json", str(out),
    )
    data = json.loads(out.read_text())
    by_variant = {r["variant"]: r for r in data["rows"]}
    # all-recompute keeps exactly what torch.utils.checkpoint keeps
    assert by_variant["remat_dist full"]["saved_bytes"] == by_variant["torch.utils.checkpoint"]["saved_bytes"]
    assert data["steady_state"]["flat"]
    tp = data["distributed"]["layouts"]["tp"]
    # comm-free replay issues the no-checkpoint backward collectives, no more
    assert sum(tp["remat save"]["backward"].values()) == sum(tp["none"]["backward"].values())
    # the saved column counts the collective outputs "save" keeps for comm-free
    # replay (hooks never see them): per block, the row-wise attention.wo and mlp.w2
    # all-reduce outputs, each (batch, seq, dim) float32 -- an independent count
    cfg = data["distributed"]["config"]
    block_out = cfg["batch"] * cfg["seq"] * cfg["dim"] * 4
    kept = [cfg["layers"] * 2 * block_out] * 2
    assert tp["remat save"]["kept_collective_bytes_per_rank"] == kept
    assert tp["remat replay"]["kept_collective_bytes_per_rank"] == [0, 0]
    assert [s - r for s, r in zip(
        tp["remat save"]["saved_bytes_per_rank"], tp["remat replay"]["saved_bytes_per_rank"]
    )] == kept
    fsdp = data["distributed"]["layouts"]["fsdp"]
    assert fsdp["remat save"]["kept_collective_bytes_per_rank"] == [0, 0]
    # TP: one agreement and one report per step, one gloo operation each, no store
    # request once the stake's group is made; FSDP2 has no stake: nothing
    assert tp["remat replay"]["per_step"]["operations"] == 2
    assert tp["remat replay"]["per_step"]["store_requests"] == 0
    assert fsdp["remat replay"]["per_step"].get("operations", 0) == 0
    costs = tp["ledger_cost_us"]
    assert costs["operations_per_step"] == 2 and costs["store_requests_per_step"] == 0
    assert "of which kept coll." in proc.stdout
    assert "x torch" in proc.stdout and "distributed (2 gloo ranks" in proc.stdout


def test_bench_saved_column_counts_torch_checkpoint_inputs():
    # torch.utils.checkpoint keeps each block's input; the saved column (a
    # saved-tensors-hooks count) includes them, and so does the report, which
    # labels them as torch's: layers x (batch, seq, dim) float32.
    from benchmarks import core as bench
    from remat_dist.models import GPT, GPTConfig, make_batch
    from remat_dist.report import build_saved_tensors_report

    config = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=3)
    model = GPT(config)
    tokens, targets = make_batch(config, 2, seed=0)
    inputs = config.n_layers * 2 * config.seq_len * config.dim * 4
    columns = {}
    for name in ("none", "torch.utils.checkpoint", "selective (save matmuls)"):
        model.block_runner = bench.VARIANTS[name]()
        columns[name] = bench._saved_bytes(model, tokens, targets)
        loss = model.loss(tokens, targets)
        report = build_saved_tensors_report(loss)
        loss.backward()
        model.zero_grad(set_to_none=True)
        assert columns[name] == report.total_bytes
        assert report.torch_checkpoint_input_bytes == (inputs if name != "none" else 0)
    assert columns["torch.utils.checkpoint"] < columns["none"]
    # selective checkpointing keeps its matmul outputs (its cache, which no hook
    # sees) on top of the inputs
    assert columns["torch.utils.checkpoint"] < columns["selective (save matmuls)"]
    assert columns["selective (save matmuls)"] < columns["none"]


def _run_bench_script(name: str, tmp_path: Path, *args: str) -> tuple[Any, Any]:
    """Run ``python -m benchmarks.<name> --iters 3`` with ``args``; its process and
    its JSON."""
    out = tmp_path / f"{name}.json"
    proc = run_benchmark(name, "--iters", "3", *args, "--json", str(out), timeout=300)
    return proc, json.loads(out.read_text())


def test_fsdp2_overhead_script_writes_json(tmp_path):
    proc, result = _run_bench_script("fsdp2_overhead", tmp_path, "--split")
    # --split: the same table again for remat_dist without the distributed observers
    assert "remat_dist, no observers:" in proc.stdout
    for rows in (result["rows"], result["split_rows"]):
        assert set(rows) == {"step", "forward", "backward"}
        for row in rows.values():
            lo, hi = row["x_torch_ci95"]
            assert lo <= row["x_torch"] <= hi
    # two instances of each variant by default; the A/A row compares torch's two
    assert result["replicas"] == 2
    assert "A/A (torch.utils.checkpoint, replica 0 / replica 1)" in proc.stdout
    lo, hi = result["aa_row"]["x_torch_ci95"]
    assert lo <= result["aa_row"]["x_torch"] <= hi


def test_fsdp2_inplace_script_times_every_checkpoint_and_its_replay(tmp_path):
    proc, result = _run_bench_script("fsdp2_inplace", tmp_path)
    rows, blocks = result["rows"], result["config"]["n_layers"]
    # one sample per block call, forward and backward, in both variants
    per_variant = {"remat_dist": 3 * blocks, "torch": 3 * blocks}
    assert {p: r["samples"] for p, r in rows.items()} == dict.fromkeys(
        ("forward pre", "forward post", "backward"), per_variant
    )
    for row in rows.values():
        assert row["excess_us"] == pytest.approx(row["remat_us"] - row["torch_us"])
    # a block's backward holds its replay and kernels: far more than its set-up
    assert rows["backward"]["torch_us"] > rows["forward pre"]["torch_us"]
    assert "forward pre" in proc.stdout


def test_tp_overhead_script_issues_the_same_collectives_and_writes_json(tmp_path):
    _, result = _run_bench_script("tp_overhead", tmp_path)
    assert result["world_size"] == 2 and set(result["rows"]) == {"cpu", "wall"}
    counts = result["collectives_per_step"]
    # the replay re-issues the forward's collectives: the same ones as torch's,
    # which are those of no checkpointing plus the replayed ones
    assert counts["remat replay"] == counts["torch.utils.checkpoint"]
    assert counts["remat replay"]["backward"] > counts["remat replay"]["forward"] > 0
    assert counts["none"]["forward"] == counts["remat replay"]["forward"]
    assert counts["none"]["backward"] < counts["remat replay"]["backward"]
    for row in result["rows"].values():
        lo, hi = row["x_torch_ci95"]
        assert lo <= row["x_torch"] <= hi
    assert counts["torch + interception"] == counts["torch.utils.checkpoint"]
    assert set(result["x_control"]) == {"cpu", "wall"}
    for row in result["x_control"].values():
        for v in ("remat replay", "torch + interception"):
            lo, hi = row[v]["ci95"]
            assert lo <= row[v]["median"] <= hi
    assert set(result["x_none"]) == {"cpu", "wall"}
    for row in result["x_none"].values():
        assert row["none_ms"] > 0
        for v in ("torch.utils.checkpoint", "remat replay"):
            lo, hi = row[v]["ci95"]
            assert lo <= row[v]["median"] <= hi
    # each rank's backward was held by one agreement and one report per step
    for kind in ("agreement", "report"):
        assert len(result["remat_waits_ms"][kind]) == 2
        for row in result["remat_waits_ms"][kind]:
            assert 0 < row["median"] <= row["p90"]


def test_instruction_counts_sum_each_functions_own_cost_and_skip_inclusive_call_costs(
    tmp_path,
):
    from benchmarks import fsdp2_instructions as script

    # the shape of a callgrind dump: own costs per line, and after each calls= line
    # the call's inclusive cost, which is the callee's and must not count twice
    body = (
        "events: Ir\nsummary: 0\n\nfn=(1) outer\n10 100\n+2 50\ncfn=(2) inner\n"
        "calls=3 40\n12 7000\n*  25\nfn=(2)\n40 7000\n"
    )
    for index, phase, scale in ((0, "forward", 1), (0, "backward", 2),
                                (1, "forward", 3), (1, "backward", 4)):
        text = body.replace(" 100\n", f" {100 * scale}\n")
        (tmp_path / f"cg.1.{index}{phase}").write_text(
            f"desc: Trigger: dump variant{index}-{phase}\n{text}"
        )
    (tmp_path / "cg.1").write_text("desc: Trigger: Program termination\n" + body)
    counts = script._read_dumps(str(tmp_path))
    assert counts == {
        ("torch.utils.checkpoint", "forward"): 100 + 50 + 25 + 7000,
        ("torch.utils.checkpoint", "backward"): 200 + 50 + 25 + 7000,
        ("remat_dist", "forward"): 300 + 50 + 25 + 7000,
        ("remat_dist", "backward"): 400 + 50 + 25 + 7000,
    }
