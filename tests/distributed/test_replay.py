"""Distributed replay guarantees on real gloo ranks: the ledger, verified replay,
comm-free replay, plan consistency; divergence raises on every rank, never hangs."""

from __future__ import annotations

import torch
import torch.distributed as dist

import remat_dist as remat
from remat_dist.core import live_records
from remat_dist.distributed import ledger_of
from remat_dist.distributed._collectives import RecordCollectives, observe_collectives
from remat_dist.models import GPT, Block, GPTConfig, make_batch
from remat_dist.testing import DistContext, distributed
from tests.distributed._tp import tp_mlp as _tp_mlp

BOUND_S = 30.0  # every rank must raise well within this

CONFIG = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=3)


def _tp_gpt(mesh, policy, collectives):
    model = GPT(CONFIG)
    if policy is not None:
        remat.apply_remat(model, blocks=Block, policy=policy, collectives=collectives)
    remat.shard_model(model, mesh, blocks=Block, tp_plan=remat.shard.reference_tp_plan())
    return model


def _step(model, prefix="layers."):
    """Forward + backward; grads (local shards), backward collectives, ledgers."""
    tokens, targets = make_batch(CONFIG, 4, seed=3)
    before = {id(r) for r in live_records()}  # earlier tests' graphs may live on
    loss = model.loss(tokens, targets)
    mine = [r for r in live_records() if id(r) not in before]
    states = [ledger_of(r) for r in mine if r.name.startswith(prefix)]
    states = [s for s in states if s is not None]
    counter = RecordCollectives()
    with observe_collectives(counter):
        loss.backward()
    grads = {n: getattr(p.grad, "_local_tensor", p.grad).clone() for n, p in model.named_parameters()}
    return grads, [e.op for e in counter.ledger.entries], states


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tp_replay_and_comm_free_replay(ctx: DistContext):
    ref, ref_ops, _ = _step(_tp_gpt(ctx.mesh, None, "replay"))
    assert len(ref_ops) == 12  # 3 blocks x 4 column-wise layers: input-grad all-reduces

    grads, ops, states = _step(_tp_gpt(ctx.mesh, "full", "replay"))
    assert all(torch.equal(ref[n], grads[n]) for n in ref)
    forward = [len(s.ledger) for s in states]
    replayed = [s.replays[-1]["issued"] for s in states]
    assert forward == [2, 2, 2]  # the row-wise all-reduces of attention and MLP
    # each forward collective replayed at most once, and backward issues exactly
    # the no-checkpoint collectives plus the replayed ones
    assert all(0 < r <= f for r, f in zip(replayed, forward))
    assert len(ops) == len(ref_ops) + sum(replayed)

    grads, ops, states = _step(_tp_gpt(ctx.mesh, "full", "save"))
    assert all(torch.equal(ref[n], grads[n]) for n in ref)
    assert len(ops) == len(ref_ops)  # comm-free: nothing replayed
    assert [s.replays[-1]["issued"] for s in states] == [0, 0, 0]
    assert all(s.replays[-1]["served"] > 0 for s in states)
    kept = sum(s.ledger.kept_nbytes for s in states)
    assert kept == 3 * 2 * 4 * CONFIG.seq_len * CONFIG.dim * 4  # the kept outputs


@distributed(world_size=2)
def test_a_forward_without_collectives_shares_no_ledger_with_one_that_issues(ctx: DistContext):
    # a forward that issues no collective keeps a shared empty ledger until its
    # first one: the next checkpoint's collectives must land in its own ledger only
    x = torch.ones(4, requires_grad=True)

    def quiet(t):
        return t * t  # saves t: its record lives with the graph

    def talks(t):
        y = t * t
        dist.all_reduce(y)
        return y

    before = {id(r) for r in live_records()}
    outs = [
        remat.checkpoint(region_name=name)(fn)(x)
        for name, fn in (("quiet.0", quiet), ("talks", talks), ("quiet.1", quiet))
    ]
    mine = {r.name: ledger_of(r) for r in live_records() if id(r) not in before}
    assert [len(mine[n].ledger) for n in ("quiet.0", "talks", "quiet.1")] == [0, 1, 0]
    assert mine["quiet.0"].ledger is mine["quiet.1"].ledger  # the shared empty one
    assert mine["talks"].ledger is not mine["quiet.0"].ledger
    sum(o.sum() for o in outs).backward()
    # all_reduce sums the two ranks' y; its backward is torch's identity
    assert torch.equal(x.grad, torch.full((4,), 6.0))
    assert [len(mine[n].ledger) for n in ("quiet.0", "quiet.1")] == [0, 0]


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tp_attention_saved_skips_its_collectives_on_replay(ctx: DistContext):
    ref, ref_ops, _ = _step(_tp_gpt(ctx.mesh, None, "replay"))
    grads, ops, states = _step(_tp_gpt(ctx.mesh, {"attention": "save"}, "replay"))
    assert all(torch.equal(ref[n], grads[n]) for n in ref)
    # attention's all-reduce is inside the save region: skipped with it
    assert all(s.spans for s in states)
    assert len(ops) == len(ref_ops) + sum(s.replays[-1]["issued"] for s in states)
    assert all(s.replays[-1]["issued"] <= 1 for s in states)


@distributed(world_size=4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
def test_2d_fsdp_tp_replay_modes_equal_reference(ctx: DistContext):
    def build(policy, collectives):
        model = GPT(CONFIG)
        if policy is not None:
            remat.apply_remat(model, blocks=Block, policy=policy, collectives=collectives)
        remat.shard_model(model, ctx.mesh, blocks=Block, tp_plan=remat.shard.reference_tp_plan())
        return model

    ref, ref_ops, _ = _step(build(None, "replay"))
    for mode in ("replay", "save"):
        grads, ops, states = _step(build("full", mode))
        assert all(torch.equal(ref[n], grads[n]) for n in ref), mode
        assert all(s.fsdp_collectives == 0 for s in states)  # FSDP hooks are outside
        if mode == "save":
            assert ops == ref_ops
        else:
            assert len(ops) == len(ref_ops) + sum(s.replays[-1]["issued"] for s in states)


def test_no_process_group_records_nothing():
    assert not dist.is_initialized()
    x = torch.randn(4, 8, requires_grad=True)
    out = remat.checkpoint(region_name="single")(lambda t: t.sin().cos())(x)
    rec = [r for r in live_records() if r.name == "single"][-1]
    assert ledger_of(rec) is None
    out.sum().backward()
    remat.distributed.check_plan_consistency()  # a no-op


@distributed(world_size=2, mesh_shape=(2,))
def test_per_region_comm_free_replay(ctx: DistContext):
    mlp = _tp_mlp(ctx.mesh)
    x = torch.randn(4, 8, requires_grad=True)

    def body(t):
        h = remat.region(mlp, "served", recompute=True, collectives="save")(t.sin())
        return mlp(h.tanh()).cos()  # this one is replayed and verified

    out = remat.checkpoint(region_name="per_region_blk")(body)(x)
    (state,) = [ledger_of(r) for r in live_records() if r.name == "per_region_blk"]
    assert len(state.ledger) == 2
    assert [e.kept is not None for e in state.ledger.entries] == [True, False]
    out.sum().backward()
    replay = state.replays[-1]
    assert (replay["served"], replay["issued"]) == (1, 1)  # region served, tail re-issued
    ref_x = x.detach().clone().requires_grad_()
    ref = mlp(torch.tanh(mlp(ref_x.sin()))).cos()
    ref.sum().backward()
    assert torch.equal(ref_x.grad, x.grad)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("dp",))
def test_checkpoint_around_an_fsdp2_module_call(ctx: DistContext):
    # checkpoint(block)(x) on a fully_shard-ed block puts FSDP2's pre-forward
    # all-gather inside the checkpoint: counted, not replayed or verified
    from torch.distributed.fsdp import fully_shard

    def run(wrap):
        model = GPT(CONFIG)
        for block in model.layers:
            fully_shard(block, mesh=ctx.mesh)
        fully_shard(model, mesh=ctx.mesh)
        if wrap:
            model.block_runner = lambda b, x, n: remat.checkpoint(region_name=f"fsdp_call.{n}")(b)(x)
        return _step(model, prefix="fsdp_call.")

    ref, ref_ops, _ = run(False)
    grads, ops, states = run(True)
    assert all(torch.equal(ref[n], grads[n]) for n in ref)
    assert len(states) == CONFIG.n_layers
    assert all(s.fsdp_collectives > 0 and len(s.ledger) == 0 for s in states)
    assert ops == ref_ops  # no extra collective in backward


@distributed(world_size=2)
def test_all_gather_objects_without_numpy(ctx: DistContext):
    # torch's *_object collectives need numpy; ours must not (the demo runs
    # before the test extra, numpy included, is installed).
    import sys

    saved = sys.modules.get("numpy")
    sys.modules["numpy"] = None  # type: ignore[assignment]  # import numpy fails
    try:
        from remat_dist.distributed import all_gather_objects

        got = all_gather_objects({"rank": ctx.rank, "pad": "x" * (10 + 1000 * ctx.rank)})
    finally:
        sys.modules["numpy"] = saved  # type: ignore[assignment]
    assert [g["rank"] for g in got] == [0, 1]
    assert [len(g["pad"]) for g in got] == [10, 1010]


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_reports_count_collective_outputs_kept_for_comm_free_replay(ctx: DistContext):
    # collectives="save" keeps each collective's output on the record: every
    # report counts those bytes (the ledger's own record extension), on top of
    # what autograd saves (an independent count of the saved tensors).
    from remat_dist.report import (
        build_saved_tensors_report,
        format_saved_tensors_report,
        saved_tensors_summary,
    )
    from remat_dist.testing import SavedBytesCounter

    tokens, targets = make_batch(CONFIG, 4, seed=3)
    totals = {}
    for mode in ("replay", "save"):
        model = _tp_gpt(ctx.mesh, "full", mode)
        with SavedBytesCounter(model.parameters()) as counter:
            before = {id(r) for r in live_records()}
            loss = model.loss(tokens, targets)
        mine = [r for r in live_records() if id(r) not in before]
        kept = sum(ledger_of(r).ledger.kept_nbytes for r in mine)
        report = build_saved_tensors_report(loss)
        summary = saved_tensors_summary(loss)
        assert report.total_bytes == counter.activation_bytes + kept
        assert summary["total_bytes"] == report.total_bytes
        text = format_saved_tensors_report(loss)
        assert ("kept for comm-free replay" in text) == (mode == "save"), text
        totals[mode] = (report.total_bytes, kept)
        loss.backward()
    # 3 blocks x 2 row-wise all-reduce outputs of (4, 16, 32) float32 each
    assert totals["save"][1] == 3 * 2 * 4 * CONFIG.seq_len * CONFIG.dim * 4
    assert totals["replay"][1] == 0
    assert totals["save"][0] == totals["replay"][0] + totals["save"][1]
