"""Collective outputs kept for comm-free replay (``collectives="save"``) in every
report: the current-memory report, the saved-tensors report and its summary, and
the cross-rank report, each against an independent count (the all-reduce output's
shape times its element size) and labelled as kept for comm-free replay."""

from __future__ import annotations

import re

import torch

from remat_dist.testing import DistContext, distributed

BATCH = 4


def _tp_mlp(mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    return parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _bytes(text: str, prefix: str) -> int | None:
    m = re.search(rf"^{re.escape(prefix)}: (\d+) B", text, re.M)
    return None if m is None else int(m.group(1))


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_every_report_counts_kept_collective_outputs(ctx: DistContext):
    import remat_dist as remat
    from remat_dist.report import (
        build_saved_tensors_report,
        gather_saved_tensors_report,
    )

    mlp = _tp_mlp(ctx.mesh)
    x = torch.randn(BATCH, 8, requires_grad=True)
    # RowwiseParallel's output all-reduce: one (BATCH, 8) float32 tensor per call
    kept_expected = BATCH * 8 * torch.float32.itemsize
    results = {}
    for mode in ("replay", "save"):
        seen: list[str] = []

        def body(t, seen=seen):
            out = mlp(t).relu()
            if not remat.is_recomputing():
                seen.append(remat.format_current_memory_report())
            return out

        y = remat.checkpoint(region_name="mlp", collectives=mode)(body)(x)
        loss = y.square().sum()
        current = seen[0]
        report = build_saved_tensors_report(loss)
        summary = report.summary()
        text = report.format()
        cross = gather_saved_tensors_report(loss, dst=0)
        results[mode] = (report.total_bytes, report.regions_bytes)
        if mode == "save":
            # current-memory report: a ::kept region labelled as such
            assert _bytes(current, "mlp::kept") == kept_expected, current
            assert "(kept for comm-free replay)" in current
            # saved-tensors report and summary
            assert report.kept_collective_bytes == kept_expected
            assert summary["kept_collective_bytes"] == kept_expected
            assert f"collective outputs kept for comm-free replay: {kept_expected} B" in text
        else:
            assert "mlp::kept" not in current and "comm-free" not in current
            assert summary["kept_collective_bytes"] == 0
            assert "comm-free" not in text
        if ctx.rank == 0:
            assert [r.total_bytes for r in cross.ranks] == [report.total_bytes] * 2
        else:
            assert cross is None
        loss.backward()
    # the kept outputs are the only difference between the two modes
    assert results["save"][0] - results["replay"][0] == kept_expected
    assert results["save"][1] - results["replay"][1] == kept_expected


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_dtensor_rows_show_this_ranks_shape_and_the_global_one(ctx: DistContext):
    import remat_dist as remat

    mlp = _tp_mlp(ctx.mesh)
    x = torch.randn(BATCH, 8, requires_grad=True)
    keep = remat.region(mlp, "mlp", recompute=False)
    y = remat.checkpoint(region_name="block")(lambda t: keep(t).relu())(x)
    text = remat.format_saved_tensors_report(y.square().sum())
    # the column-wise weight (16, 8) is (8, 8) on each of the 2 ranks
    assert "(8, 8) [global (16, 8)]" in text or "(8, 8) [global (8, 16)]" in text, text
