"""The fault matrix: one rank diverges, raises, stalls or dies; every rank raises the
documented error within its bound, no rank is left inside a collective, and (where
the process group survives) the next step runs clean.

Real gloo groups through the harness: TP on 2 ranks, FSDP2 on 2 ranks, FSDP x TP on
a 2 x 2 mesh, with ``apply_remat`` + ``shard_model`` as a user writes them.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import remat_dist as remat
from remat_dist.distributed._collectives import RecordCollectives, observe_collectives
from remat_dist.models import GPT, Block, GPTConfig, make_batch
from remat_dist.testing import (
    DistContext,
    DistributedTestError,
    dist_context,
    distributed,
    run_distributed,
)
from tests.distributed._tp import tp_mlp as _tp_mlp

BOUND_S = 30.0
"""Every rank raises within this (the issue's bound)."""
GOAL_S = 5.0
"""Divergence that needs no timeout is reported within this."""

CONFIG = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=3)


def _model(mesh, policy, *, collectives="replay", tp=True):
    model = GPT(CONFIG)
    if policy is not None:
        remat.apply_remat(model, blocks=Block, policy=policy, collectives=collectives)
    plan = remat.shard.reference_tp_plan() if tp else None
    remat.shard_model(model, mesh, blocks=Block, tp_plan=plan)
    return model


def _backward_ops(loss) -> list[str]:
    """Backward, counting the collectives this rank issues in it."""
    counter = RecordCollectives()
    try:
        with observe_collectives(counter):
            loss.backward()
    finally:
        _backward_ops.last = [e.op for e in counter.ledger.entries]  # type: ignore[attr-defined]
    return _backward_ops.last  # type: ignore[attr-defined]


def _expect(run, error, *patterns, bound=GOAL_S):
    t0 = time.perf_counter()
    with pytest.raises(error) as ei:
        run()
    elapsed = time.perf_counter() - t0
    assert elapsed < bound, (elapsed, str(ei.value))
    for p in patterns:
        assert p in str(ei.value), str(ei.value)
    return ei.value


def _same_on_every_rank(value) -> None:
    gathered = remat.distributed.all_gather_objects(value)  # no numpy needed
    assert all(g == gathered[0] for g in gathered), gathered


def _clean_step(mesh, *, tp=True) -> None:
    """A fresh model, remat on every block: gradients equal the run without remat."""
    tokens, targets = make_batch(CONFIG, 4, seed=5)
    grads = []
    for policy in (None, "full"):
        model = _model(mesh, policy, tp=tp)
        model.loss(tokens, targets).backward()
        grads.append(
            {n: getattr(p.grad, "_local_tensor", p.grad) for n, p in model.named_parameters()}
        )
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def _on_replay(model, block: int, action) -> None:
    """Run ``action()`` when block ``block``'s MLP is called during a replay."""

    def hook(module, args):
        if remat.is_recomputing():
            action()

    model.layers[block].mlp.register_forward_pre_hook(hook)


def _loss(model):
    tokens, targets = make_batch(CONFIG, 4, seed=3)
    return model.loss(tokens, targets)


# --- plan divergence: caught by the agreement of the ranks at stake, before any
# --- backward collective


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tp_rank_dependent_save_decision(ctx: DistContext):
    policy = {"attention": "save"} if ctx.rank == 1 else "full"
    loss = _loss(_model(ctx.mesh, policy))
    err = _expect(lambda: _backward_ops(loss), remat.errors.PlanMismatchError, "layers.0::attention", "ranks [1]")
    assert _backward_ops.last == []  # no rank issued a collective of this backward
    _same_on_every_rank(str(err))
    _clean_step(ctx.mesh)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tp_rank_that_checkpoints_nothing(ctx: DistContext):
    # rank 1's policy checkpoints no block: apply_remat still makes it take part
    policy = "full" if ctx.rank == 0 else (lambda name, module: "none")
    loss = _loss(_model(ctx.mesh, policy))
    _expect(lambda: _backward_ops(loss), remat.errors.PlanMismatchError, "layers.0", "(nothing more)")
    assert _backward_ops.last == []
    _clean_step(ctx.mesh)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_join_agreements_where_checkpoint_is_called_directly(ctx: DistContext):
    # no apply_remat and so no pre-hook: rank 1 checkpoints nothing in this forward,
    # and join_agreements() makes it meet rank 0 in the TP group's agreement (without
    # it rank 0 would wait for a peer that never comes)
    mlp = _tp_mlp(ctx.mesh)
    x = torch.randn(4, 8, requires_grad=True)

    def body(t):
        return mlp(t.sin()).cos()

    remat.distributed.join_agreements()
    y = remat.checkpoint(region_name="join_blk")(body)(x) if ctx.rank == 0 else body(x)
    err = _expect(lambda: _backward_ops(mlp(y).sum()), remat.errors.PlanMismatchError, "join_blk")
    assert _backward_ops.last == []
    _same_on_every_rank(str(err))


def test_mark_step_is_join_agreements_under_its_old_name():
    with pytest.warns(DeprecationWarning, match="remat_dist.distributed.join_agreements"):
        old = remat.distributed.mark_step
    assert old is remat.distributed.join_agreements
    with pytest.raises(AttributeError, match="no_such_name"):
        remat.distributed.no_such_name  # noqa: B018


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tp_one_block_not_checkpointed_on_one_rank(ctx: DistContext):
    # The case that used to pair a replayed all-reduce with an unrelated backward
    # all-reduce of the same shape: replays start at different points of backward.
    def policy(name, module):
        return "none" if (ctx.rank == 1 and name == "layers.1") else "full"

    loss = _loss(_model(ctx.mesh, policy))
    _expect(lambda: _backward_ops(loss), remat.errors.PlanMismatchError, "layers.1", "ranks [")
    assert _backward_ops.last == []
    _clean_step(ctx.mesh)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tp_rank_dependent_collective_mode(ctx: DistContext):
    mode = "save" if ctx.rank == 1 else "replay"
    loss = _loss(_model(ctx.mesh, "full", collectives=mode))
    _expect(lambda: _backward_ops(loss), remat.errors.PlanMismatchError, "collectives=save", "ranks [1]")
    assert _backward_ops.last == []
    _clean_step(ctx.mesh)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("dp",))
def test_fsdp2_rank_dependent_policy_is_harmless_and_free(ctx: DistContext):
    # FSDP2 with remat inside the units: no replay re-issues a collective, so a
    # rank-dependent decision cannot pair collectives wrongly; nothing is agreed
    # and the gradients are those of the run without remat.
    from remat_dist.distributed import step_stats

    before = step_stats()
    policy = {"mlp": "save"} if ctx.rank == 0 else "full"
    tokens, targets = make_batch(CONFIG, 4, seed=5)
    grads = []
    for p in (None, policy):
        model = _model(ctx.mesh, p, tp=False)
        ops = _backward_ops(model.loss(tokens, targets))
        assert ops and all(op.startswith(("_reduce_scatter", "_allgather", "reduce_scatter")) for op in ops), ops
        grads.append({n: p.grad._local_tensor for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    after = step_stats()
    assert vars(after) == vars(before)  # rounds, operations, requests, waits


def _2d_one_rank_differs_body():
    ctx = dist_context()
    remat.distributed.set_replay_timeout(2.0)
    try:
        policy = {"attention": "save"} if ctx.rank == 3 else "full"
        loss = _loss(_model(ctx.mesh, policy))
        t0 = time.perf_counter()
        try:
            _backward_ops(loss)
            outcome = "no error"
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            outcome = f"{type(exc).__name__}: {exc}"
        return time.perf_counter() - t0, outcome, _backward_ops.last
    finally:
        remat.distributed.set_replay_timeout(20.0)
        dist.destroy_process_group()  # ranks 0 and 1 timed out in a collective


def test_2d_fsdp_tp_one_rank_differs():
    # Only TP group [2, 3] is at stake on the difference: its ranks raise at once,
    # before any collective. Ranks 0 and 1 agreed among themselves and go on; their
    # next collective with rank 2 or 3 (FSDP2's reduce-scatter, with its group's
    # own timeout) fails when ranks 2 and 3 drop the group (a job's failing
    # ranks exit: the connections close at once).
    results = run_distributed(
        _2d_one_rank_differs_body, world_size=4, mesh_shape=(2, 2),
        mesh_dim_names=("dp", "tp"), timeout=60,
    )
    for rank in (2, 3):
        elapsed, outcome, ops = results[rank]
        assert outcome.startswith("PlanMismatchError"), outcome
        assert "ranks [3]" in outcome and "of ranks [2, 3]" in outcome, outcome
        assert elapsed < GOAL_S and ops == []
    for rank in (0, 1):
        elapsed, outcome, ops = results[rank]
        assert "Timed out" in outcome or "Connection" in outcome, outcome
        assert elapsed < BOUND_S, outcome


@distributed(world_size=4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
def test_two_stakes_failing_in_the_same_step(ctx: DistContext):
    # Both TP groups differ (rank 1 in [0, 1], rank 3 in [2, 3]): each raises on
    # its own ranks, naming its own rank, before any collective of the backward;
    # the next step is clean everywhere.
    remat.distributed.set_replay_timeout(2.0)
    try:
        policy = {"attention": "save"} if ctx.rank in (1, 3) else "full"
        loss = _loss(_model(ctx.mesh, policy))
        pair = [0, 1] if ctx.rank < 2 else [2, 3]
        err = _expect(lambda: _backward_ops(loss), remat.errors.PlanMismatchError, f"of ranks {pair}")
        assert f"ranks [{pair[1]}]" in str(err), str(err)
        assert _backward_ops.last == []
        err = loss = None  # the step is dropped: its graph dies
        _clean_step(ctx.mesh)
    finally:
        remat.distributed.set_replay_timeout(None)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_a_rank_that_stalls_before_its_report(ctx: DistContext):
    # Rank 1 stalls past the bound at the very end of its backward (a hook on
    # the input, after every replay and collective): rank 0 gives up at its
    # end-of-backward report and raises CollectiveReplayError naming rank 1;
    # rank 1 comes to a report its peer gave up on and raises too, saying it
    # came late. Both dropped the step: the next steps are clean on both.
    remat.distributed.set_replay_timeout(1.0)
    try:
        x = torch.randn(4, 8, requires_grad=True)
        if ctx.rank == 1:
            x.register_hook(lambda g: (time.sleep(3.0), g)[1])
        y = remat.checkpoint(region_name="report_blk")(_with_all_reduce)(x)
        if ctx.rank == 0:
            err = _expect(lambda: y.sum().backward(), remat.errors.CollectiveReplayError, bound=4.0)
            assert "ranks [1] of [0, 1] did not reach the end-of-backward report" in str(err), str(err)
        else:
            err = _expect(lambda: y.sum().backward(), remat.errors.CollectiveReplayError, bound=5.0)
            assert "this rank arrived after rank 0 had given up on the round" in str(err), str(err)
    finally:
        remat.distributed.set_replay_timeout(None)
    y = err = None
    for _ in range(2):
        x = torch.randn(4, 8, requires_grad=True)
        remat.checkpoint(region_name="after_report")(_with_all_reduce)(x).sum().backward()
        with torch.no_grad():
            expected = -torch.sin(x.sin()) * x.cos() * 2
        torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_forward_ledger_differs_on_one_rank(ctx: DistContext):
    # Same plan, but rank 0 issues a collective just before the checkpoint that
    # rank 1 issues inside it: the forward pairs, rank 1's ledger holds one more
    # collective, and the per-group ledger fingerprints differ.
    mlp = _tp_mlp(ctx.mesh)
    x = torch.randn(4, 8, requires_grad=True)

    def body(t):
        if ctx.rank == 1:
            dist.all_reduce(torch.ones(2))
        return mlp(t.sin()).cos()

    if ctx.rank == 0:
        dist.all_reduce(torch.ones(2))
    y = remat.checkpoint(region_name="ledger_blk")(body)(x)
    _expect(
        lambda: _backward_ops(mlp(y).sum()),
        remat.errors.PlanMismatchError,
        "checkpoint 'ledger_blk'",
        "ranks [0]: 1 collective(s)",
        "ranks [1]: 2 collective(s)",
    )
    assert _backward_ops.last == []
    _clean_step(ctx.mesh)


# --- divergence during replay only: absorbed, released, reported at backward's end


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tp_extra_collective_during_replay(ctx: DistContext):
    model = _model(ctx.mesh, "full")
    if ctx.rank == 1:
        _on_replay(model, 1, lambda: dist.all_reduce(torch.ones(3)))
    loss = _loss(model)
    err = _expect(
        lambda: _backward_ops(loss),
        remat.errors.CollectiveReplayError,
        "ranks [1]",
        "checkpoint 'layers.1'",
        "collective 2 of the replay",
        "expected: nothing more",
        "actual:   allreduce_",
        "f32[3]",
    )
    assert err.failed_ranks == [1]
    _same_on_every_rank(str(err))
    _clean_step(ctx.mesh)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("dp",))
def test_fsdp2_collective_in_a_replay_whose_forward_issued_none(ctx: DistContext):
    # Checkpointing inside FSDP2's units: the forward issued nothing of its own,
    # so nothing is at stake and the replay runs the light observer; a collective
    # it issues anyway is refused before it is sent, on the rank that issues it.
    model = _model(ctx.mesh, "full", tp=False)
    _on_replay(model, 2, lambda: dist.all_reduce(torch.ones(3)))
    loss = _loss(model)
    err = _expect(
        lambda: _backward_ops(loss),
        remat.errors.CollectiveReplayError,
        f"rank {ctx.rank}, checkpoint 'layers.2'",
        "expected: nothing more (this replay issues 0 of the forward's 0",
        "actual:   allreduce_",
        "f32[3]",
    )
    assert "allreduce_" not in _backward_ops.last  # type: ignore[attr-defined]
    _same_on_every_rank(str(err).replace(f"rank {ctx.rank}", "rank r"))
    _clean_step(ctx.mesh, tp=False)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tp_reshaped_collective_during_replay(ctx: DistContext):
    mlp = _tp_mlp(ctx.mesh)
    x = torch.randn(4, 8, requires_grad=True)

    def body(t):
        n = 5 if (remat.is_recomputing() and ctx.rank == 0) else 4
        buf = torch.ones(n)
        dist.all_reduce(buf)
        return mlp((t * buf[:4, None]).sin()).cos()

    def run():
        y = remat.checkpoint(region_name="shape_blk")(body)(x)
        _backward_ops(mlp(y).sum())  # TP backward all-reduces follow the replay

    err = _expect(run, remat.errors.CollectiveReplayError, "shape_blk", "ranks [0]", "f32[5]", "f32[4]")
    _same_on_every_rank(str(err))
    _clean_step(ctx.mesh)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tp_exception_during_replay(ctx: DistContext):
    model = _model(ctx.mesh, "full")

    def boom():
        raise ValueError("replay-only failure")

    if ctx.rank == 1:
        _on_replay(model, 1, boom)
    loss = _loss(model)
    err = _expect(
        lambda: _backward_ops(loss),
        remat.errors.CollectiveReplayError,
        "ranks [1]",
        "ValueError: replay-only failure",
        "checkpoint 'layers.1'",
    )
    _same_on_every_rank(str(err))
    _clean_step(ctx.mesh)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tp_exception_during_replay_of_a_later_step(ctx: DistContext):
    """From its second forward a block notes its saved DTensors in one C call each;
    a replay that fails then still completes with stand-ins of the right
    placements (from the first forward), so every rank raises together."""
    model = _model(ctx.mesh, "full")
    _loss(model).backward()
    model.zero_grad(set_to_none=True)
    failing = {"now": False}

    def boom():
        if failing["now"]:
            raise ValueError("replay-only failure")

    if ctx.rank == 1:
        _on_replay(model, 1, boom)
    failing["now"] = True
    loss = _loss(model)
    err = _expect(
        lambda: _backward_ops(loss),
        remat.errors.CollectiveReplayError,
        "ranks [1]",
        "ValueError: replay-only failure",
        "checkpoint 'layers.1'",
    )
    _same_on_every_rank(str(err))
    # the backward went on past the failed replay on rank 1: both ranks issued
    # the same collectives
    _same_on_every_rank(_backward_ops.last)  # type: ignore[attr-defined]
    _clean_step(ctx.mesh)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tp_replay_that_saves_other_tensors_on_one_rank(ctx: DistContext):
    """Rank 1's replay of a block saves two tensors its forward did not (shifting
    every later one) but runs to its end: the check at the replay's end finds the
    first that differs, and every rank raises together instead of rank 1 alone."""
    model = _model(ctx.mesh, "full")
    w = torch.ones(4, 4, requires_grad=True)
    if ctx.rank == 1:
        _on_replay(model, 1, lambda: (w * w[..., :1]).sum())  # saves w and a column
    loss = _loss(model)
    err = _expect(
        lambda: _backward_ops(loss),
        remat.errors.CollectiveReplayError,
        "ranks [1]",
        "checkpoint 'layers.1'",
        "did not reproduce its forward",
    )
    _same_on_every_rank(str(err))
    _clean_step(ctx.mesh)


def _fsdp2_replay_raises_body(path):
    ctx = dist_context()
    model = _model(ctx.mesh, "full", tp=False)

    def boom():
        raise RuntimeError("bad recompute")

    if ctx.rank == 0:
        _on_replay(model, 2, boom)
    loss = _loss(model)
    t0 = time.perf_counter()
    try:
        loss.backward()
        outcome = "no error"
    except Exception as exc:  # noqa: BLE001 - recorded for the parent
        outcome = f"{type(exc).__name__}: {exc}"
    with open(f"{path}.{ctx.rank}", "w") as f:
        f.write(f"{time.perf_counter() - t0:.3f}\n{outcome}")
    if ctx.rank == 0:
        os._exit(1)  # what an uncaught error does to a torchrun worker


def test_fsdp2_exception_in_a_replay_without_collectives(tmp_path):
    # Nothing is at stake: the replay's own error is raised at once on the rank
    # where it happens (as torch's checkpoint does); when that rank exits, its
    # peer's pending collective fails at once instead of waiting.
    path = str(tmp_path / "outcome")
    with pytest.raises(DistributedTestError):
        run_distributed(
            _fsdp2_replay_raises_body, path, world_size=2, mesh_shape=(2,),
            mesh_dim_names=("dp",), timeout=60,
        )
    elapsed, outcome = open(f"{path}.0").read().split("\n", 1)
    assert outcome == "RuntimeError: bad recompute", outcome
    assert float(elapsed) < GOAL_S
    elapsed, outcome = open(f"{path}.1").read().split("\n", 1)
    assert "Connection" in outcome or "closed" in outcome, outcome
    assert float(elapsed) < BOUND_S, outcome


@distributed(world_size=4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
def test_2d_exception_during_replay_on_one_rank(ctx: DistContext):
    model = _model(ctx.mesh, {"attention": "save"})

    def boom():
        raise ValueError("rank 2 only")

    if ctx.rank == 2:
        _on_replay(model, 0, boom)
    loss = _loss(model)
    if ctx.rank in (2, 3):
        # the stake of the failed replay: its ranks raise, with the same text
        err = _expect(lambda: _backward_ops(loss), remat.errors.CollectiveReplayError, "ranks [2]", "rank 2 only")
        text = str(err)
    else:
        # not at stake: the backward completes (rank 2 finished its own with
        # stand-ins, so every collective pairs); the job stops when ranks 2 and 3
        # raise out of the step
        _backward_ops(loss)
        text = None
    texts = remat.distributed.all_gather_objects(text)  # no numpy needed
    assert texts[2] == texts[3] and texts[0] is None and texts[1] is None
    _clean_step(ctx.mesh)


# --- plan checks


@distributed(world_size=2)
def test_plan_check_is_a_collective_call(ctx: DistContext):
    # check_plan_consistency() is a round among the group's ranks: called on one
    # rank only, that rank raises after the bound, naming the one that did not
    # come. The other took no part in it: its next call is not an error but meets
    # its peer's next call (on the stake's next group), and both compare the
    # same checkpoints (a call that did not complete compared nothing).
    remat.distributed.set_replay_timeout(1.0)
    try:
        x = torch.randn(4, 8, requires_grad=True)
        remat.checkpoint(region_name="chk_blk")(lambda t: t.sin().cos())(x)
        if ctx.rank == 0:
            err = _expect(remat.distributed.check_plan_consistency, remat.errors.PlanMismatchError, bound=4.0)
            assert "ranks [1] of [0, 1] did not reach check_plan_consistency()" in str(err)
        dist.barrier()
        remat.distributed.check_plan_consistency()
        remat.checkpoint(region_name="chk_blk")(lambda t: t.sin().cos())(x)
        remat.distributed.check_plan_consistency()
    finally:
        remat.distributed.set_replay_timeout(20.0)


@distributed(world_size=4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
def test_plan_check_honours_the_group(ctx: DistContext):
    # each TP pair compares its own plans; only the pair that differs raises
    tp_group = ctx.mesh["tp"].get_group()
    x = torch.randn(4, 8, requires_grad=True)
    name = "grp_b" if ctx.rank == 3 else "grp_a"
    remat.checkpoint(region_name=name)(lambda t: t.sin().cos())(x)
    if ctx.rank in (2, 3):
        err = _expect(lambda: remat.distributed.check_plan_consistency(tp_group), remat.errors.PlanMismatchError, "grp_b", "ranks [3]")
        assert "check_plan_consistency() of ranks [2, 3]" in str(err)
    else:
        remat.distributed.check_plan_consistency(tp_group)


@distributed(world_size=2)
def test_plan_check_step_level(ctx: DistContext):
    x = torch.randn(4, 8, requires_grad=True)

    def body(t):
        return remat.region(torch.sin, "act", recompute=True)(t).cos()

    remat.checkpoint(region_name="step_plan_a")(body)(x).sum().backward()
    remat.distributed.check_plan_consistency()  # nothing new since the last agreement: passes
    name = "step_plan_b" if ctx.rank == 0 else "step_plan_c"
    remat.checkpoint(region_name=name)(body)(x)
    _expect(remat.distributed.check_plan_consistency, remat.errors.PlanMismatchError, "step_plan_c", "ranks [1]")


# --- a rank dies during replay: bounded, never 30 minutes (a stall before a
# --- replayed collective: tests/distributed/test_bound.py)


def _die_body(path):
    ctx = dist_context()
    remat.distributed.set_replay_timeout(5.0)
    try:
        model = _model(ctx.mesh, "full")
        if ctx.rank == 1:
            _on_replay(model, 1, lambda: os._exit(3))
        loss = _loss(model)
        t0 = time.perf_counter()
        try:
            loss.backward()
            outcome = "no error"
        except Exception as exc:  # noqa: BLE001 - recorded for the parent
            outcome = f"{type(exc).__name__}: {exc}"
        with open(path, "w") as f:
            f.write(f"{time.perf_counter() - t0:.3f}\n{outcome}")
    finally:
        remat.distributed.set_replay_timeout(20.0)


def test_dead_rank_bounded(tmp_path):
    path = str(tmp_path / "rank0.txt")
    with pytest.raises(DistributedTestError):
        run_distributed(_die_body, path, world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",), timeout=60)
    elapsed, outcome = open(path).read().split("\n", 1)
    assert float(elapsed) < BOUND_S, outcome
    # gloo reports the dead peer at once, in the backward collective rank 0 is in
    assert any(m in outcome for m in ("Connection", "did not join", "Timed out")), outcome


# --- a rank that misses a round, and the wording of each bound


def _with_all_reduce(t):
    """A block whose replay re-issues an all-reduce on the world: at stake."""
    buf = torch.ones(2)
    dist.all_reduce(buf)
    return t.sin().cos() * buf[0]


@distributed(world_size=2)
def test_rank_that_never_reaches_the_agreement(ctx: DistContext):
    # Rank 1 stalls past the bound before its agreement: rank 0 raises after the
    # bound; rank 1 comes late, finds the round given up, looks for its peer on
    # the stake's next group (rank 0 is in its next forward by then), raises
    # after one more bound; the step after runs clean on both.
    remat.distributed.set_replay_timeout(1.0)
    try:
        x = torch.randn(4, 8, requires_grad=True)
        y = remat.checkpoint(region_name="late_blk")(_with_all_reduce)(x)
        if ctx.rank == 0:
            err = _expect(lambda: y.sum().backward(), remat.errors.PlanMismatchError, bound=4.5)
            assert "ranks [1] of [0, 1] did not reach the plan agreement of ranks [0, 1] within 1 s" in str(err), str(err)
        else:
            time.sleep(2.5)  # busy elsewhere
            err = _expect(lambda: y.sum().backward(), remat.errors.PlanMismatchError, bound=3.5)
            assert "this rank arrived after rank 0 had given up on the round" in str(err), str(err)
    finally:
        remat.distributed.set_replay_timeout(20.0)
    y = None  # the step is dropped: its graph dies
    x = torch.randn(4, 8, requires_grad=True)
    remat.checkpoint(region_name="after_blk")(_with_all_reduce)(x).sum().backward()


@distributed(world_size=2)
def test_replay_computes_while_its_agreement_travels(ctx: DistContext):
    # The agreement is posted when a replay starts and waited for only before the
    # first collective: rank 1 computes its replay (up to the all-reduce) before
    # rank 0 has even started backward. Rank 0 holds its backward (a hook on the
    # checkpoint's output, which runs before the replay) until rank 1 is inside
    # its replay. Were the agreement waited for at the replay's start, rank 1
    # would wait there for rank 0, which waits for rank 1: both would fail
    # (the bound, the store's wait).
    from datetime import timedelta

    signal = dist.FileStore(os.path.join(ctx.shared_dir, "signal"), 2)

    signalling = []

    def block(t):
        if ctx.rank == 1 and signalling and remat.is_recomputing():
            signal.set("rank 1 replays", "1")
        buf = torch.ones(2)
        dist.all_reduce(buf)
        return t.sin().cos() * buf[0]

    x = torch.randn(4, 8, requires_grad=True)
    # a first step sets the stake's gloo group up (all ranks take part in that)
    remat.checkpoint(region_name="posted_blk")(block)(x).sum().backward()
    x.grad = None
    signalling.append(True)
    remat.distributed.set_replay_timeout(10.0)  # generous: only a regression meets it
    try:
        y = remat.checkpoint(region_name="posted_blk")(block)(x)
        if ctx.rank == 0:
            y.register_hook(
                lambda g: (signal.wait(["rank 1 replays"], timedelta(seconds=30)), g)[1]
            )
        y.sum().backward()
    finally:
        remat.distributed.set_replay_timeout(20.0)
    with torch.no_grad():
        expected = -torch.sin(x.sin()) * x.cos() * 2
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


@distributed(world_size=2)
def test_backward_raising_outside_a_replay_on_one_rank(ctx: DistContext):
    # Rank 1's backward raises in a hook after the replay: rank 0 waits at the
    # end-of-backward report; rank 1's next step joins the missed report saying
    # so (or rank 0 gives up after the bound), and both run the steps after that.
    remat.distributed.set_replay_timeout(1.0)
    try:
        x = torch.randn(4, 8, requires_grad=True)
        if ctx.rank == 1:
            x.register_hook(lambda g: (_ for _ in ()).throw(ValueError("hook failed")))
        y = remat.checkpoint(region_name="hook_blk")(_with_all_reduce)(x)
        if ctx.rank == 0:
            err = _expect(lambda: y.sum().backward(), remat.errors.CollectiveReplayError, bound=5.0)
            text = str(err)
            assert "rank 1: backward raised before the end of the step" in text or (
                "did not reach the end-of-backward report" in text
            ), text
        else:
            _expect(lambda: y.sum().backward(), ValueError, "hook failed")
    finally:
        remat.distributed.set_replay_timeout(20.0)
    for _ in range(2):
        x = torch.randn(4, 8, requires_grad=True)
        remat.checkpoint(region_name="next_blk")(_with_all_reduce)(x).sum().backward()


@distributed(world_size=2)
def test_agreement_finished_at_backwards_end_where_no_collective_follows(ctx: DistContext):
    # The block's all-reduce is in a save region, so its replay issues no
    # collective and nothing else in backward does: the agreement posted at the
    # replay's start is finished at backward's end. A rank-dependent decision of
    # another region still raises on both ranks, and the next steps run clean.
    def block(recompute_inner):
        def run(t):
            buf = remat.region(_all_reduced_ones, "comm", recompute=False)()
            remat.recompute_needs_tensor(buf)
            inner = remat.region(torch.sin, "inner", recompute=recompute_inner)(t)
            if not recompute_inner:
                remat.recompute_needs_tensor(inner)
            return inner.cos() * buf[0]

        return run

    x = torch.randn(4, 8, requires_grad=True)
    loss = remat.checkpoint(region_name="end_blk")(block(True))(x).sum()
    assert _backward_ops(loss) == []
    loss = remat.checkpoint(region_name="end_blk")(block(ctx.rank == 0))(x).sum()
    err = _expect(lambda: _backward_ops(loss), remat.errors.PlanMismatchError, "inner", "ranks [1]")
    assert _backward_ops.last == []
    _same_on_every_rank(str(err))
    err = loss = None  # the step is dropped: its graph dies
    for _ in range(2):
        x.grad = None
        remat.checkpoint(region_name="end_blk")(block(True))(x).sum().backward()
        with torch.no_grad():
            expected = -torch.sin(x.sin()) * x.cos() * 2
        torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


def _all_reduced_ones():
    buf = torch.ones(2)
    dist.all_reduce(buf)
    return buf


@distributed(world_size=2)
def test_agreement_costs_nothing_in_forward(ctx: DistContext):
    from remat_dist.distributed import step_stats

    x = torch.randn(4, 8, requires_grad=True)
    before = step_stats()
    y = remat.checkpoint(region_name="cost_blk")(_with_all_reduce)(x)
    assert step_stats() == before  # no round, no message in forward
    y.sum().backward()
    after = step_stats()
    assert (after.agreements - before.agreements, after.reports - before.reports) == (1, 1)
    # a round is one gloo all_reduce; the store only saw the stake group's
    # set-up (the first step) or nothing
    assert after.operations - before.operations == 2
    x = torch.randn(4, 8, requires_grad=True)
    y = remat.checkpoint(region_name="cost_blk")(_with_all_reduce)(x)
    y.sum().backward()
    again = step_stats()
    assert again.store_requests == after.store_requests
    assert again.operations - after.operations == 2


# --- logging: quiet by default, rank-prefixed, one line per agreement


@distributed(world_size=2)
def test_logging_says_each_agreement_and_each_divergence_with_the_rank(ctx: DistContext):
    import logging

    lines: list[tuple[int, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append((record.levelno, record.getMessage()))

    logger = logging.getLogger("remat_dist")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        x = torch.randn(4, 8, requires_grad=True)
        remat.checkpoint(region_name="log_blk")(_with_all_reduce)(x).sum().backward()
        name = "log_a" if ctx.rank == 0 else "log_b"
        y = remat.checkpoint(region_name=name)(_with_all_reduce)(x)
        with pytest.raises(remat.errors.PlanMismatchError):
            y.sum().backward()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    prefix = f"[rank {ctx.rank}] "
    assert all(text.startswith(prefix) for _, text in lines), lines
    agreed = [t for lv, t in lines if lv == logging.INFO and "checkpoint(s) agreed in" in t]
    assert len(agreed) == 1 and " ms" in agreed[0], lines
    errors = [t for lv, t in lines if lv == logging.ERROR]
    assert len(errors) == 1 and "log_b" in errors[0], lines


@pytest.mark.parametrize("layout", ["fsdp2", "tp"])
@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("x",))
def test_info_log_says_what_was_set_up_and_what_happened(ctx: DistContext, layout):
    # Once: what apply_remat set up, and what is at stake (or that nothing is);
    # per step: only what happened (an agreement, with its cost).
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("remat_dist")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        model = _model(ctx.mesh, "full", tp=layout == "tp")
        for _ in range(3):
            _loss(model).backward()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    setup = [t for t in lines if "apply_remat(GPT): 3 of 3 selected blocks (Block)" in t]
    assert len(setup) == 1 and "collectives=replay" in setup[0], lines
    quiet = [t for t in lines if "replayed in this backward in no replay group" in t]
    at_stake = [t for t in lines if "ranks [0, 1] form a replay group" in t]
    agreed = [t for t in lines if "checkpoint(s) agreed in" in t]
    if layout == "fsdp2":
        assert len(quiet) == 1 and not at_stake and not agreed, lines
        assert quiet[0].startswith(f"[rank {ctx.rank}] 3 checkpoint(s)"), quiet
    else:
        assert not quiet and len(at_stake) == 1 and len(agreed) == 3, lines


@pytest.mark.slow
def test_remat_dist_log_env_turns_logging_on():
    # one fresh interpreter: quiet first (no handler, warnings still printed by
    # Python's last resort), then with REMAT_DIST_LOG=info as importing reads it
    import subprocess
    import sys

    code = (
        "import logging, os, sys, remat_dist, remat_dist._logging as L\n"
        "log = logging.getLogger('remat_dist.x')\n"
        "log.info('hello'); log.warning('over budget')\n"
        "print('--- loud ---', file=sys.stderr, flush=True)\n"
        "os.environ['REMAT_DIST_LOG'] = 'info'; L._configure()\n"
        "log.info('hello')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "REMAT_DIST_LOG"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    quiet, _, loud = out.stderr.partition("--- loud ---")
    assert out.returncode == 0, out.stderr
    assert "hello" not in quiet
    assert "over budget" in quiet  # warnings are never swallowed
    assert "remat_dist.x INFO: hello" in loud, out.stderr


# --- recovery: after any error remat_dist raises, the next step runs clean


def _checked_step(ctx: DistContext, group) -> None:
    """A clean step as a user's loop runs it: forward, ``check_plan_consistency``
    (over ``group``), backward; the gradients equal the run without remat."""
    tokens, targets = make_batch(CONFIG, 4, seed=5)
    grads = []
    for policy in (None, "full"):
        model = _model(ctx.mesh, policy)
        loss = model.loss(tokens, targets)
        if policy is not None:
            remat.distributed.check_plan_consistency(group)
        loss.backward()
        grads.append({n: _local(p.grad) for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def _local(t):
    return getattr(t, "_local_tensor", t)


def _policy_for(case: str, rank: int):
    if case == "save_decision":
        return {"mlp": "save"} if rank == 1 else "full", "replay"
    if case == "block_on_one_rank":
        return (lambda name, module: "none" if rank == 1 and name == "layers.1" else "full"), "replay"
    if case == "collective_mode":
        return "full", "save" if rank == 1 else "replay"
    return "full", "replay"  # the check on one rank only: the plans agree


@pytest.mark.parametrize("group_form", ["world", "tp_group"])
@pytest.mark.parametrize(
    "case",
    ["save_decision", "block_on_one_rank", "collective_mode", "check_on_one_rank",
     "check_on_one_rank_other_skips_backward"],
)
@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_next_step_is_clean_after_the_check_raises(ctx: DistContext, case, group_form):
    # The held-out matrix's cases: step 1 raises from check_plan_consistency()
    # called after the forward (the loop catches it and drops the step); step 2,
    # the same plan on every rank, must run clean: its check passes and its
    # backward's agreement compares only step 2's checkpoints.
    group = None if group_form == "world" else ctx.mesh.get_group()
    remat.distributed.set_replay_timeout(1.0)
    try:
        policy, mode = _policy_for(case, ctx.rank)
        loss = _loss(_model(ctx.mesh, policy, collectives=mode))
        if case.startswith("check_on_one_rank") and ctx.rank == 1:
            if case == "check_on_one_rank":
                # it goes on to backward: its agreement meets rank 0's check
                _expect(lambda: loss.backward(), remat.errors.PlanMismatchError, "ran different rounds")
        elif case == "check_on_one_rank_other_skips_backward" and ctx.rank == 0:
            err = _expect(lambda: remat.distributed.check_plan_consistency(group), remat.errors.PlanMismatchError, bound=4.0)
            assert "ranks [1] of [0, 1] did not reach check_plan_consistency()" in str(err)
        elif case == "check_on_one_rank":
            _expect(lambda: remat.distributed.check_plan_consistency(group), remat.errors.PlanMismatchError, "ran different rounds")
        else:
            err = _expect(lambda: remat.distributed.check_plan_consistency(group), remat.errors.PlanMismatchError, "ranks [1]")
            _same_on_every_rank(str(err))
        loss = None  # the step is dropped: its graph dies
        _checked_step(ctx, group)
    finally:
        remat.distributed.set_replay_timeout(20.0)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_next_step_is_clean_after_the_report_raises_on_the_same_model(ctx: DistContext):
    # The report path on one model kept across steps: rank 1's replay raises in
    # step 1 (every rank raises CollectiveReplayError at backward's end); the
    # hook is removed and step 2 on the same model runs bitwise.
    model = _model(ctx.mesh, "full")
    reference = _model(ctx.mesh, None)
    reference.load_state_dict(model.state_dict())
    handle = None
    if ctx.rank == 1:
        def boom(module, args):
            if remat.is_recomputing():
                raise ValueError("step 1 only")
        handle = model.layers[1].mlp.register_forward_pre_hook(boom)
    _expect(lambda: _loss(model).backward(), remat.errors.CollectiveReplayError, "ranks [1]", "step 1 only")
    if handle is not None:
        handle.remove()
    model.zero_grad()
    for m in (model, reference):
        _loss(m).backward()
    for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(_local(p.grad), _local(q.grad)), n
