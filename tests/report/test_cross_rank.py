"""The cross-rank report: the pure aggregation, and real 2- and 4-rank gathers."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from remat_dist.report import (
    CrossRankReport,
    aggregate_summaries,
    build_saved_tensors_report,
    gather_saved_tensors_report,
    saved_tensors_summary,
)
from remat_dist.testing import distributed, run_distributed
from tests.report.plans import model_and_batch

KiB = 1024


def summary(rank, regions, outside=0, inputs=0):
    """A per-rank summary as saved_tensors_summary makes it (plus the rank)."""
    return {
        "rank": rank,
        "total_bytes": sum(regions.values()) + outside + inputs,
        "outside_regions_bytes": outside,
        "checkpoint_input_bytes": inputs,
        "regions": [{"name": k, "bytes": v} for k, v in regions.items()],
    }


def layers(n, each):
    return {f"layers.{i}": each for i in range(n)}


def test_aggregate_statistics_heaviest_rank_and_imbalance():
    summaries = [
        summary(2, layers(2, 300), outside=50, inputs=10),
        summary(0, layers(2, 100), outside=50, inputs=10),
        summary(1, {"layers.0": 100}, outside=50, inputs=10),
        summary(3, layers(2, 100) | {"extra": 40}, outside=50, inputs=10),
    ]
    report = aggregate_summaries(summaries)
    assert report.world_size == 4
    assert [r.rank for r in report.ranks] == [0, 1, 2, 3]  # sorted by rank
    assert [r.total_bytes for r in report.ranks] == [260, 160, 660, 300]
    assert [r.regions_bytes for r in report.ranks] == [200, 100, 600, 240]
    names = [r.name for r in report.regions]
    assert names == ["layers.0", "layers.1", "extra"]
    l1 = report.regions[1]
    assert l1.bytes == (100, 0, 300, 100)  # a rank without the region counts 0
    assert (l1.min, l1.median, l1.max, l1.max_rank) == (0, 100, 300, 2)
    assert l1.imbalance == pytest.approx(300 / 125)
    t = report.totals
    assert (t.min, t.median, t.max, t.max_rank) == (160, 280, 660, 2)
    assert t.imbalance == pytest.approx(660 / (1380 / 4))
    # ties: the lowest rank holding the max
    tie = aggregate_summaries([summary(0, {"a": 5}), summary(1, {"a": 5})])
    assert tie.regions[0].max_rank == 0 and tie.regions[0].imbalance == 1.0


def test_all_zero_and_odd_medians():
    report = aggregate_summaries([summary(r, {"a": 0}) for r in range(3)])
    assert report.totals.imbalance == 1.0 and report.regions[0].imbalance == 1.0
    report = aggregate_summaries([summary(0, {"a": 1}), summary(1, {"a": 2})])
    assert report.regions[0].median == 1.5


def test_to_dict_keys_and_json_round_trip():
    report = aggregate_summaries(
        [summary(r, layers(3, 100 * (r + 1)), outside=7, inputs=r) for r in range(2)]
    )
    d = report.to_dict()
    assert set(d) == {"world_size", "ranks", "regions", "totals"}
    assert d["world_size"] == 2
    assert set(d["ranks"][0]) == {
        "rank",
        "total_bytes",
        "outside_regions_bytes",
        "checkpoint_input_bytes",
    }
    assert set(d["regions"][0]) == {
        "name",
        "bytes",
        "min",
        "median",
        "max",
        "max_rank",
        "imbalance",
        "input_bytes",  # added to the §7 keys: a region's inputs on each rank
    }
    assert set(d["totals"]) == {"min", "median", "max", "max_rank", "imbalance"}
    assert d["regions"][0]["bytes"] == [100, 200]
    assert d["regions"][0]["max_rank"] == 1
    text = json.dumps(d)
    back = CrossRankReport.from_dict(json.loads(text))
    assert back == report
    assert back.to_dict() == d
    assert back.format() == report.format()


def test_format_collapses_identical_ranks_and_groups_regions():
    summaries = [summary(r, layers(4, 300 * KiB), outside=KiB) for r in (0, 1, 2, 3, 5)]
    summaries.append(summary(4, layers(4, 600 * KiB), outside=KiB))
    text = aggregate_summaries(summaries).format()
    lines = text.splitlines()
    assert lines[0] == (
        "saved for backward across 6 ranks: max 2.3 MiB on rank 4, median 1.2 MiB, "
        "min 1.2 MiB, imbalance 1.71 (max/mean)"
    )
    rank_lines = [ln for ln in lines if ln.startswith("  rank")]
    assert rank_lines[0].startswith(
        "  ranks 0-3,5:  1.2 MiB  = 1.2 MiB + 0 B + 1.0 KiB"
    )
    assert rank_lines[1].startswith("  rank 4:")
    assert rank_lines[1].endswith("<- heaviest")
    (region_line,) = [ln for ln in lines if "layers." in ln]
    assert region_line.startswith(
        "  x4 layers.0-3 (each)  min 300.0 KiB, median 300.0 KiB, max 600.0 KiB "
        "(rank 4), imbalance 1.71"
    )
    assert region_line.endswith("(ranks 0-3,5: 300.0 KiB; rank 4: 600.0 KiB)")


def test_format_equal_everywhere_and_many_ranks_stay_short():
    same = aggregate_summaries([summary(r, layers(2, 64)) for r in range(8)])
    text = same.format()
    assert "  ranks 0-7:  128 B" in text
    assert "  x2 layers.0-1 (each)  64 B on every rank" in text
    # 64 ranks, all different: a bounded number of lines, heaviest first
    many = aggregate_summaries([summary(r, layers(48, 1000 + r)) for r in range(64)])
    lines = many.format().splitlines()
    assert len(lines) <= 16
    rank_lines = [ln for ln in lines if ln.startswith("  rank")]
    assert rank_lines[0].startswith("  rank 63:") and "<- heaviest" in rank_lines[0]
    assert rank_lines[-1].startswith("  rank 0:")  # the lightest
    assert "  ... 57 more rank(s) in 57 group(s), 46.9 KiB to 49.5 KiB" in lines
    assert any(ln.startswith("  x48 layers.0-47 (each)  min 1000 B") for ln in lines)
    # many regions that differ: the heaviest, in forward order, then a count
    uneven = aggregate_summaries(
        [summary(r, {f"layers.{i}": i * (r + 1) for i in range(30)}) for r in range(2)]
    )
    region_lines = uneven.format().split("per region: bytes on each rank\n")[1]
    region_lines = region_lines.splitlines()
    assert len(region_lines) == 12
    assert region_lines[0].startswith("  layers.19  ")
    assert region_lines[-1] == "  ... 19 lighter region(s)"
    # a long list of identical ranks is cut, and counted
    half = [summary(r, layers(2, 64 if r % 3 else 128)) for r in range(64)]
    line = next(
        ln
        for ln in aggregate_summaries(half).format().splitlines()
        if "ranks 1-2" in ln
    )
    assert line.startswith("  ranks 1-2,4-5,7-8,10-11,13-14,16-17,19-20,...(42 ranks):")


def test_single_process_without_a_group():
    model, tokens, targets = model_and_batch("full")
    loss = model.loss(tokens, targets)
    report = gather_saved_tensors_report(loss)
    assert report is not None and report.world_size == 1
    assert report.ranks[0].total_bytes == build_saved_tensors_report(loss).total_bytes


# -- real ranks ----------------------------------------------------------------------


def gather_unequal(plan: str, dst: int):
    """On every rank: a batch of rank + 1 sequences, the local summary, the gather."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, tokens, targets = model_and_batch(plan, batch_size=rank + 1, seed=rank)
    loss = model.loss(tokens, targets)
    local = saved_tensors_summary(loss)
    report = gather_saved_tensors_report(loss, dst=dst)
    loss.backward()  # the graph is intact
    return rank, local, None if report is None else report.to_dict()


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_across_ranks_with_unequal_batches(world_size):
    dst = world_size - 1
    results = run_distributed(
        gather_unequal, "attention_saved", dst, world_size=world_size, timeout=120
    )
    by_rank = {rank: (local, d) for rank, local, d in results}
    assert all(by_rank[r][1] is None for r in range(world_size) if r != dst)
    report = CrossRankReport.from_dict(by_rank[dst][1])
    assert report.world_size == world_size
    for r, entry in enumerate(report.ranks):
        local = by_rank[r][0]
        assert entry.rank == r
        assert entry.total_bytes == local["total_bytes"]
        assert entry.outside_regions_bytes == local["outside_regions_bytes"]
        assert entry.checkpoint_input_bytes == local["checkpoint_input_bytes"]
    totals = [e.total_bytes for e in report.ranks]
    assert totals == sorted(totals) and len(set(totals)) == world_size
    assert report.totals.max_rank == world_size - 1
    assert report.totals.imbalance == pytest.approx(
        max(totals) / (sum(totals) / world_size)
    )
    assert [g.name for g in report.regions] == [f"layers.{i}" for i in range(4)]
    for g in report.regions:
        assert g.max_rank == world_size - 1
        # per-sequence activations: rank r keeps (r + 1) x what rank 0 keeps
        assert list(g.bytes) == [g.bytes[0] * (r + 1) for r in range(world_size)]
    text = report.format()
    assert f"across {world_size} ranks" in text
    assert f"rank {world_size - 1}:" in text and "<- heaviest" in text


def dtensor_outside_save():
    from torch.distributed.tensor import Shard, distribute_tensor

    from remat_dist.testing import dist_context

    mesh = dist_context().mesh
    x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]).requires_grad_()
    y = x.sin()  # saves x: a DTensor whose local shard is (4, 4)
    report = build_saved_tensors_report(y.sum())
    return report.outside_regions_bytes, report.total_bytes


def test_dtensor_saves_count_their_local_shard():
    results = run_distributed(dtensor_outside_save, world_size=2, mesh_shape=(2,))
    assert results == [(64, 64), (64, 64)]


@distributed(world_size=2, mesh_shape=(2,))
def test_dtensor_checkpoint_input_counts_its_local_shard(ctx):
    from torch.distributed.tensor import Shard, distribute_tensor

    import remat_dist as remat

    x = distribute_tensor(torch.randn(8, 4), ctx.mesh, [Shard(0)]).requires_grad_()

    def body(t):
        s = remat.region(torch.sin, "sin", recompute=False)(t)
        remat.recompute_needs_tensor(s)
        return s.cos()

    y = remat.checkpoint(region_name="c")(body)(x)
    report = build_saved_tensors_report(y.sum())
    assert report.checkpoint_input_bytes == 0  # x: counted by the region that saves it
    assert report.regions_bytes == 64 + 64  # x's shard and the kept output's shard


def test_region_inputs_are_shown_per_region():
    # a fully recomputed block keeps 0 B beyond its inputs: the line shows both
    summaries = [
        {**summary(r, layers(2, 0), inputs=2 * 1024 * (r + 1)),
         "regions": [{"name": f"layers.{i}", "bytes": 0, "input_bytes": 1024 * (r + 1)}
                     for i in range(2)]}
        for r in range(2)
    ]
    report = aggregate_summaries(summaries)
    assert report.regions[0].input_bytes == (1024, 2048)
    assert report.to_dict()["regions"][0]["input_bytes"] == [1024, 2048]
    assert "+ inputs 1.0 KiB-2.0 KiB" in report.format()
    assert CrossRankReport.from_dict(report.to_dict()) == report


def test_heaviest_is_marked_only_where_ranks_differ():
    from remat_dist.report import aggregate_summaries

    def summary(total):
        return {
            "total_bytes": total, "regions_bytes": 0, "outside_regions_bytes": total,
            "checkpoint_input_bytes": 0, "parameter_bytes": 0, "user_hook_bytes": 0,
            "kept_collective_bytes": 0, "regions": [], "outside": [],
        }

    equal = aggregate_summaries([summary(1024), summary(1024)]).format()
    assert "heaviest" not in equal, equal
    unequal = aggregate_summaries([summary(1024), summary(2048)]).format()
    assert "<- heaviest" in unequal, unequal


def test_budget_left_unused_with_every_block_recomputed_says_why():
    from remat_dist.report import BudgetReport, RankBudget, StagePlan

    def rank(decisions, bound):
        stage = StagePlan("the model", ("layers.0", "layers.1"), 1, decisions, bound)
        return RankBudget(0, 3 * 1024, None, bound, (stage,))

    full = (("layers.0", "full"), ("layers.1", "full"))
    text = BudgetReport((rank(full, 2 * 1024),), None).format()
    assert "every block recomputed in full with 1.0 KiB of the budget unused" in text, text
    mixed = (("layers.0", "full"), ("layers.1", "save attention"))
    assert "unused" not in BudgetReport((rank(mixed, 2 * 1024),), None).format()
