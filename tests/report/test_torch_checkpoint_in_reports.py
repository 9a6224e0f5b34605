"""torch.utils.checkpoint (non-reentrant, checkpoint_wrapper too) in the reports.

What torch's checkpoint keeps for backward is its inputs (on its ``_CheckpointFrame``);
its forward's saves are recompute handles. ``SavedBytesCounter`` is an outer
saved-tensors hook: inside torch's checkpoint torch's own hook is innermost, so the
counter sees the checkpoint's inputs (packed by ``save_inputs`` before that hook is
pushed) and not the recomputed saves -- the same bytes the report should count.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)

import remat_dist as remat
from remat_dist.report import (
    aggregate_summaries,
    build_saved_tensors_report,
    format_current_memory_report,
)
from remat_dist.testing import SavedBytesCounter

DIM, N_LAYERS = 16, 3
X_BYTES = 2 * 8 * DIM * 4  # one (2, 8, 16) float32 residual-stream tensor: 1 KiB


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, 4 * DIM)
        self.out = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.fc(self.ln(x))))


def _model() -> tuple[nn.ModuleList, nn.Linear]:
    torch.manual_seed(0)
    return nn.ModuleList(Block() for _ in range(N_LAYERS)), nn.Linear(DIM, 2)


def _torch(block, h, i):
    return tuc.checkpoint(block, h, use_reentrant=False)


def _remat(block, h, i):
    return remat.checkpoint(region_name=f"layers.{i}")(block)(h)


def _mixed(block, h, i):
    return _torch(block, h, i) if i % 2 else _remat(block, h, i)


def _forward(wrap, blocks=None, head=None):
    """Forward under the independent counter; returns (report, counter, loss)."""
    if blocks is None:
        blocks, head = _model()
    x = torch.randn(2, 8, DIM)
    params = [*blocks.parameters(), *head.parameters()]
    with SavedBytesCounter(params) as count:
        h = x
        for i, block in enumerate(blocks):
            h = wrap(block, h, i)
        loss = torch.tanh(head(h)).sum()
    return build_saved_tensors_report(loss), count, loss


def test_torch_checkpoint_regions_count_their_inputs():
    report, count, loss = _forward(_torch)
    # 3 inputs (1 KiB each) + head's input (1 KiB) + tanh's output (128 B)
    assert count.activation_bytes == 4 * X_BYTES + 128
    assert report.total_bytes == count.activation_bytes
    assert report.checkpoint_input_bytes == N_LAYERS * X_BYTES
    assert report.torch_checkpoint_input_bytes == N_LAYERS * X_BYTES
    assert report.regions_bytes == 0  # their forward saves are recomputed

    s = report.summary()
    assert s["torch_checkpoint"] == {
        "regions": N_LAYERS,
        "input_bytes": N_LAYERS * X_BYTES,
        "recompute_handles": s["torch_checkpoint"]["recompute_handles"],
        "cached_bytes": 0,  # no selective policy: nothing cached
    }
    assert s["torch_checkpoint"]["recompute_handles"] > 0
    names = [r["name"] for r in s["regions"]]
    assert names == [f"torch.utils.checkpoint.{i}" for i in range(N_LAYERS)]
    for r in s["regions"]:
        assert r["kind"] == "torch.utils.checkpoint"
        assert (r["bytes"], r["storages"], r["input_bytes"]) == (0, 0, X_BYTES)

    text = report.format()
    assert "of which torch.utils.checkpoint inputs: 3.0 KiB in 3 storages" in text
    assert "1.0 KiB  x3  torch.utils.checkpoint.0-2  (1 storage each)" in text

    cross = aggregate_summaries([s, s]).to_dict()
    assert [r["name"] for r in cross["regions"]] == names
    assert cross["regions"][0]["input_bytes"] == [X_BYTES, X_BYTES]
    assert "x3 torch.utils.checkpoint.0-2 (each)" in aggregate_summaries([s]).format()
    loss.backward()


def test_checkpoint_wrapper_reports_like_torch_checkpoint():
    blocks, head = _model()
    wrapped = nn.ModuleList(checkpoint_wrapper(b) for b in blocks)
    report, count, loss = _forward(lambda b, h, i: b(h), wrapped, head)
    assert report.total_bytes == count.activation_bytes == 4 * X_BYTES + 128
    assert report.torch_checkpoint_input_bytes == N_LAYERS * X_BYTES
    assert len(report.torch_checkpoints) == N_LAYERS
    loss.backward()


def test_mixed_and_remat_full_recompute_match_torch():
    reports = {}
    for name, wrap in (("torch", _torch), ("remat", _remat), ("mixed", _mixed)):
        report, count, loss = _forward(wrap)
        assert report.total_bytes == count.activation_bytes, name
        reports[name] = report
        loss.backward()
    torch_r, remat_r, mixed_r = reports["torch"], reports["remat"], reports["mixed"]
    # remat_dist full recompute keeps what torch's checkpoint keeps: the inputs
    assert remat_r.total_bytes == torch_r.total_bytes == mixed_r.total_bytes
    assert remat_r.checkpoint_input_bytes == torch_r.checkpoint_input_bytes
    assert [cp.input_bytes for cp in remat_r.checkpoints] == [
        cp.input_bytes for cp in torch_r.checkpoints
    ]
    assert remat_r.torch_checkpoints == []  # remat's own frames are not torch's
    # mixed: forward order, each kind labelled
    s = mixed_r.summary()
    assert [r["name"] for r in s["regions"]] == [
        "layers.0",
        "torch.utils.checkpoint.0",
        "layers.2",
    ]
    assert "kind" not in s["regions"][0]
    assert s["torch_checkpoint"]["input_bytes"] == X_BYTES
    assert s["checkpoint_input_bytes"] == N_LAYERS * X_BYTES


def test_torch_checkpoint_input_counted_once():
    lin = nn.Linear(DIM, DIM)
    x = torch.randn(4, DIM, requires_grad=True)
    with SavedBytesCounter(lin.parameters()) as count:
        h = torch.sin(x)  # the checkpoint's input, also saved by MulBackward0
        y = tuc.checkpoint(lambda t: torch.sin(lin(t)), h, use_reentrant=False)
        loss = (y * h).sum()
    report = build_saved_tensors_report(loss)
    assert report.total_bytes == count.activation_bytes
    assert report.torch_checkpoint_input_bytes == h.numel() * 4
    mul = [g for g in report.outside if g.node_type == "MulBackward0"][0]
    counted_in = [r.counted_in for r in mul.rows if r.storage_nbytes == h.numel() * 4]
    assert "torch.utils.checkpoint.0 inputs" in counted_in
    loss.backward()


def test_current_memory_report_inside_torch_checkpoint():
    seen: list[str] = []

    def fn(a, w):
        h = torch.sin(a @ w)
        seen.append(format_current_memory_report())
        return h.cos()

    a = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    out = tuc.checkpoint(fn, a, w, use_reentrant=False)
    lines = seen[0].splitlines()
    assert lines[0].startswith("torch.utils.checkpoint: 0 B resident (")
    assert lines[1] == (
        "torch.utils.checkpoint inputs: 384 B in 2 storages (kept so that replay can start)"
    )
    out.sum().backward()
    assert format_current_memory_report().startswith("no checkpoint is running")


def _sac_linear_saved(block, h, i):
    # torchtitan's selective "op" AC shape: keep every matmul's output, recompute
    # the rest (torch's create_selective_checkpoint_contexts)
    def policy(ctx, op, *args, **kwargs):
        keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return tuc.CheckpointPolicy.MUST_SAVE if keep else tuc.CheckpointPolicy.PREFER_RECOMPUTE

    def contexts():
        return tuc.create_selective_checkpoint_contexts(policy)

    return tuc.checkpoint(block, h, use_reentrant=False, context_fn=contexts)


def test_selective_checkpoint_cache_is_counted():
    report, count, loss = _forward(_sac_linear_saved)
    # independent count: per block, the two linear layers' outputs (fc: 4*DIM wide,
    # out: DIM wide) cached by torch, plus the block's input
    cached = N_LAYERS * (X_BYTES * 4 + X_BYTES)
    torch_cps = report.torch_checkpoints
    assert len(torch_cps) == N_LAYERS
    assert sum(cp.nbytes for cp in torch_cps) == cached
    assert report.torch_checkpoint_input_bytes == N_LAYERS * X_BYTES
    summary = report.summary()
    assert summary["torch_checkpoint"]["cached_bytes"] == cached
    assert summary["regions_bytes"] == cached
    text = report.format()
    assert "of which op outputs cached by torch's selective checkpointing: 15.0 KiB" in text
    assert "torch.utils.checkpoint.0::selective cache: 5.0 KiB" in text
    # the outside-hook counter cannot see the cache (torch keeps it in its dispatch
    # mode, not as saved tensors): report total = counter + cache
    assert report.total_bytes == count.activation_bytes + cached
    loss.backward()


def test_current_memory_report_inside_a_selective_checkpoint():
    seen: list[str] = []

    def fn(a, w):
        h = torch.sin(a @ w)
        seen.append(format_current_memory_report())
        return h.cos()

    def contexts():
        return tuc.create_selective_checkpoint_contexts([torch.ops.aten.mm.default])

    a = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    out = tuc.checkpoint(fn, a, w, use_reentrant=False, context_fn=contexts)
    lines = seen[0].splitlines()
    assert lines[0].startswith("torch.utils.checkpoint: 128 B resident ("), lines
    assert "torch.utils.checkpoint::selective cache: 128 B" in seen[0]
    out.sum().backward()
