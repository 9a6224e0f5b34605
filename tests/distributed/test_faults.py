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
from remat_dist.models import GPT, GPTConfig, make_batch
from remat_dist.models.gpt import Block
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
    plan = remat.reference_tp_plan() if tp else None
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
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
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


# --- plan divergence: caught by the step agreement, before any backward collective


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tp_rank_dependent_save_decision(ctx: DistContext):
    policy = {"attention": "save"} if ctx.rank == 1 else "full"
    loss = _loss(_model(ctx.mesh, policy))
    err = _expect(lambda: _backward_ops(loss), remat.PlanMismatchError, "layers.0::attention", "ranks [1]")
    assert _backward_ops.last == []  # no rank issued a collective of this backward
    _same_on_every_rank(str(err))
    _clean_step(ctx.mesh)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tp_rank_that_checkpoints_nothing(ctx: DistContext):
    # rank 1's policy checkpoints no block: apply_remat still makes it take part
    policy = "full" if ctx.rank == 0 else (lambda name, module: "none")
    loss = _loss(_model(ctx.mesh, policy))
    _expect(lambda: _backward_ops(loss), remat.PlanMismatchError, "layers.0", "(nothing more)")
    assert _backward_ops.last == []
    _clean_step(ctx.mesh)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tp_one_block_not_checkpointed_on_one_rank(ctx: DistContext):
    # The case that used to pair a replayed all-reduce with an unrelated backward
    # all-reduce of the same shape: replays start at different points of backward.
    def policy(name, module):
        return "none" if (ctx.rank == 1 and name == "layers.1") else "full"

    loss = _loss(_model(ctx.mesh, policy))
    _expect(lambda: _backward_ops(loss), remat.PlanMismatchError, "layers.1", "ranks [")
    assert _backward_ops.last == []
    _clean_step(ctx.mesh)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tp_rank_dependent_collective_mode(ctx: DistContext):
    mode = "save" if ctx.rank == 1 else "replay"
    loss = _loss(_model(ctx.mesh, "full", collectives=mode))
    _expect(lambda: _backward_ops(loss), remat.PlanMismatchError, "collectives=save", "ranks [1]")
    assert _backward_ops.last == []
    _clean_step(ctx.mesh)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("dp",))
def test_fsdp2_rank_dependent_policy(ctx: DistContext):
    policy = {"mlp": "save"} if ctx.rank == 0 else "full"
    loss = _loss(_model(ctx.mesh, policy, tp=False))
    _expect(lambda: _backward_ops(loss), remat.PlanMismatchError, "layers.0::mlp", "ranks [")
    assert _backward_ops.last == []  # not even FSDP2's reduce-scatter
    _clean_step(ctx.mesh, tp=False)


@distributed(world_size=4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
def test_2d_fsdp_tp_one_rank_differs(ctx: DistContext):
    policy = {"attention": "save"} if ctx.rank == 3 else "full"
    loss = _loss(_model(ctx.mesh, policy))
    _expect(lambda: _backward_ops(loss), remat.PlanMismatchError, "ranks [3]")
    assert _backward_ops.last == []
    _clean_step(ctx.mesh)


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
        remat.PlanMismatchError,
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
        remat.CollectiveReplayError,
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

    err = _expect(run, remat.CollectiveReplayError, "shape_blk", "ranks [0]", "f32[5]", "f32[4]")
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
        remat.CollectiveReplayError,
        "ranks [1]",
        "ValueError: replay-only failure",
        "checkpoint 'layers.1'",
    )
    _same_on_every_rank(str(err))
    _clean_step(ctx.mesh)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("dp",))
def test_fsdp2_exception_in_a_replay_without_collectives(ctx: DistContext):
    # The block's replay issues nothing; FSDP2's reduce-scatters follow it. The
    # failing rank keeps issuing them (its replay is completed with stand-ins).
    model = _model(ctx.mesh, "full", tp=False)

    def boom():
        raise RuntimeError("bad recompute")

    if ctx.rank == 0:
        _on_replay(model, 2, boom)
    loss = _loss(model)
    err = _expect(lambda: _backward_ops(loss), remat.CollectiveReplayError, "ranks [0]", "bad recompute")
    _same_on_every_rank(str(err))
    _clean_step(ctx.mesh, tp=False)


@distributed(world_size=4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
def test_2d_exception_during_replay_on_one_rank(ctx: DistContext):
    model = _model(ctx.mesh, {"attention": "save"})

    def boom():
        raise ValueError("rank 2 only")

    if ctx.rank == 2:
        _on_replay(model, 0, boom)
    loss = _loss(model)
    err = _expect(lambda: _backward_ops(loss), remat.CollectiveReplayError, "ranks [2]", "rank 2 only")
    _same_on_every_rank(str(err))
    _clean_step(ctx.mesh)


# --- plan checks


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_plan_check_on_one_rank_only(ctx: DistContext):
    # An explicit check only moves the agreement earlier: a rank that does not
    # call it meets the other at its backward's start.
    for _ in range(2):
        model = _model(ctx.mesh, "full")
        loss = _loss(model)
        if ctx.rank == 0:
            remat.check_plan_consistency()
        loss.backward()
    _clean_step(ctx.mesh)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_plan_check_on_one_rank_with_a_mismatch(ctx: DistContext):
    policy = {"mlp": "save"} if ctx.rank == 1 else "full"
    loss = _loss(_model(ctx.mesh, policy))
    run = remat.check_plan_consistency if ctx.rank == 0 else lambda: _backward_ops(loss)
    _expect(run, remat.PlanMismatchError, "layers.0::mlp")
    _clean_step(ctx.mesh)


@distributed(world_size=2)
def test_plan_check_step_level(ctx: DistContext):
    x = torch.randn(4, 8, requires_grad=True)

    def body(t):
        return remat.region(torch.sin, "act", recompute=True)(t).cos()

    remat.checkpoint(region_name="step_plan_a")(body)(x).sum().backward()
    remat.check_plan_consistency()  # nothing new since the last agreement: passes
    name = "step_plan_b" if ctx.rank == 0 else "step_plan_c"
    remat.checkpoint(region_name=name)(body)(x)
    _expect(remat.check_plan_consistency, remat.PlanMismatchError, "step_plan_c", "ranks [1]")


# --- a rank stalls or dies during replay: bounded, never 30 minutes


def _stall_body(seconds):
    ctx = dist_context()
    remat.set_replay_timeout(seconds)
    try:
        model = _model(ctx.mesh, "full")
        if ctx.rank == 1:
            _on_replay(model, 1, lambda: time.sleep(seconds * 2))
        loss = _loss(model)
        t0 = time.perf_counter()
        with pytest.raises((remat.CollectiveReplayError, RuntimeError)) as ei:
            loss.backward()
        return time.perf_counter() - t0, type(ei.value).__name__, str(ei.value)[:400]
    finally:
        remat.set_replay_timeout(20.0)
        # a timed-out collective leaves gloo's pairs out of step: retire the group
        dist.destroy_process_group()


def test_stalled_rank_bounded():
    results = run_distributed(_stall_body, 2.0, world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
    for elapsed, _kind, text in results:
        assert elapsed < 4 * 2.0 + 2.0, (elapsed, text)
    # rank 0 waits in a backward collective (bounded while a remat step runs),
    # rank 1 in the first collective after its stall; neither waits 30 minutes
    for _elapsed, _kind, text in results:
        assert any(m in text for m in ("Timed out", "did not join", "Connection closed")), text
    assert "Timed out" in results[0][2], results[0]


def _die_body(path):
    ctx = dist_context()
    remat.set_replay_timeout(5.0)
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
        remat.set_replay_timeout(20.0)


def test_dead_rank_bounded(tmp_path):
    path = str(tmp_path / "rank0.txt")
    with pytest.raises(DistributedTestError):
        run_distributed(_die_body, path, world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",), timeout=60)
    elapsed, outcome = open(path).read().split("\n", 1)
    assert float(elapsed) < BOUND_S, outcome
    # gloo reports the dead peer at once, in the backward collective rank 0 is in
    assert any(m in outcome for m in ("Connection", "did not join", "Timed out")), outcome


# --- a rank that misses a round, and the wording of each bound


@distributed(world_size=2)
def test_rank_that_never_reaches_the_agreement(ctx: DistContext):
    remat.set_replay_timeout(1.0)
    try:
        x = torch.randn(4, 8, requires_grad=True)
        y = remat.checkpoint(region_name="late_blk")(lambda t: t.sin().cos())(x)
        if ctx.rank == 0:
            err = _expect(lambda: y.sum().backward(), remat.PlanMismatchError, bound=4.5)
            assert "ranks [1] of the step group did not reach the plan agreement (backward) within 1 s" in str(err)
        else:
            time.sleep(4.5)  # busy elsewhere (well past the harness FileStore's
            # coarse 2 s wait granularity); then it comes, reads the abort, raises
            err = _expect(remat.check_plan_consistency, remat.PlanMismatchError, bound=1.0)
            assert "rank 0 gave up waiting first" in str(err)
    finally:
        remat.set_replay_timeout(20.0)
    x = torch.randn(4, 8, requires_grad=True)
    remat.checkpoint(region_name="after_blk")(lambda t: t.sin().cos())(x).sum().backward()


@distributed(world_size=2)
def test_backward_raising_outside_a_replay_on_one_rank(ctx: DistContext):
    # Rank 1's backward raises in a hook after the replay: rank 0 waits at the
    # end-of-backward report; rank 1's next step joins the missed report saying
    # so (or rank 0 gives up after the bound), and both run the steps after that.
    remat.set_replay_timeout(1.0)
    try:
        x = torch.randn(4, 8, requires_grad=True)
        if ctx.rank == 1:
            x.register_hook(lambda g: (_ for _ in ()).throw(ValueError("hook failed")))
        y = remat.checkpoint(region_name="hook_blk")(lambda t: t.sin().cos())(x)
        if ctx.rank == 0:
            err = _expect(lambda: y.sum().backward(), remat.CollectiveReplayError, bound=5.0)
            text = str(err)
            assert "rank 1: backward raised before the end of the step" in text or (
                "did not reach the end of backward" in text
            ), text
        else:
            _expect(lambda: y.sum().backward(), ValueError, "hook failed")
    finally:
        remat.set_replay_timeout(20.0)
    for _ in range(2):
        x = torch.randn(4, 8, requires_grad=True)
        remat.checkpoint(region_name="next_blk")(lambda t: t.sin().cos())(x).sum().backward()


@distributed(world_size=2)
def test_verify_plan_is_deprecated_and_costs_nothing_in_forward(ctx: DistContext):
    from remat_dist.distributed._step import current_step

    x = torch.randn(4, 8, requires_grad=True)
    before = current_step().round.seq
    if ctx.rank == 0:  # a plan check asked for on one rank only: harmless
        with pytest.warns(DeprecationWarning, match="verify_plan"):
            run = remat.checkpoint(region_name="vp_blk", verify_plan=True)
    else:
        run = remat.checkpoint(region_name="vp_blk")
    y = run(lambda t: t.sin().cos())(x)
    assert current_step().round.seq == before  # no store round in forward
    y.sum().backward()
    assert current_step().round.seq == before + 2  # the step's agreement and report


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
        remat.checkpoint(region_name="log_blk")(lambda t: t.sin().cos())(x).sum().backward()
        name = "log_a" if ctx.rank == 0 else "log_b"
        y = remat.checkpoint(region_name=name)(lambda t: t.sin().cos())(x)
        with pytest.raises(remat.PlanMismatchError):
            y.sum().backward()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    prefix = f"[rank {ctx.rank}] "
    assert all(text.startswith(prefix) for _, text in lines), lines
    agreed = [t for lv, t in lines if lv == logging.INFO and "plan agreed at backward" in t]
    assert len(agreed) == 1 and " ms" in agreed[0], lines
    errors = [t for lv, t in lines if lv == logging.ERROR]
    assert len(errors) == 1 and "log_b" in errors[0], lines


def test_remat_dist_log_env_turns_logging_on():
    import subprocess
    import sys

    code = (
        "import logging, remat_dist; log = logging.getLogger('remat_dist.x'); "
        "log.info('hello'); log.warning('over budget')"
    )
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    loud = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "REMAT_DIST_LOG": "info"},
    )
    assert "hello" not in quiet.stderr
    assert "over budget" in quiet.stderr  # warnings are never swallowed
    assert "remat_dist.x INFO: hello" in loud.stderr, loud.stderr
