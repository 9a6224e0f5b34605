"""Nothing remat_dist keeps grows with the steps (slow tier).

Long runs on real gloo ranks, one random rank straggling between forward and
backward now and then by up to half the bound (the rounds wait for it: no
error): the c10d store's key count, the process's threads, remat_dist's gloo
groups and the open file descriptors are counted at steps 1, 100 and the last;
they stay flat, and every step's loss equals the same model's without remat,
bitwise. ``REMAT_DIST_SOAK_STEPS`` shortens the runs while developing.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
import torch.nn.functional as F

import remat_dist as remat
from remat_dist._torch import _c10d
from remat_dist.distributed import step_stats
from remat_dist.models import GPT, Block, GPTConfig, GPTStage, block_tp_plan, make_batch
from remat_dist.testing import dist_context, run_distributed

pytestmark = pytest.mark.slow

STEPS = int(os.environ.get("REMAT_DIST_SOAK_STEPS", "1000"))
BOUND_S = 2.0
STRAGGLE_P = 0.05
"""Share of steps in which one random rank straggles (by up to ``BOUND_S / 2``)."""
CONFIG = GPTConfig(vocab_size=32, seq_len=8, dim=16, n_heads=2, n_layers=2)
MARKS = (1, 100, STEPS)


def _counts() -> dict[str, int]:
    return {
        "store keys": _c10d.default_store().num_keys(),
        "threads": len(os.listdir("/proc/self/task")),
        "gloo groups": step_stats().groups,
        "file descriptors": len(os.listdir("/proc/self/fd")),
    }


def _straggle(step: int, world: int, rank: int) -> None:
    """The same draw on every rank: whether this step straggles, and who."""
    draw = random.Random(step)
    if draw.random() < STRAGGLE_P and draw.randrange(world) == rank:
        time.sleep(draw.uniform(0, BOUND_S / 2))


def _soak_tp() -> dict[int, dict[str, int]]:
    ctx = dist_context()
    remat.distributed.set_replay_timeout(BOUND_S)
    try:
        models = []
        for policy in (None, "full"):
            torch.manual_seed(0)
            model = GPT(CONFIG)
            if policy is not None:
                remat.apply_remat(model, blocks=Block, policy=policy)
            remat.shard_model(model, ctx.mesh, blocks=Block, tp_plan=remat.shard.reference_tp_plan())
            models.append((model, torch.optim.SGD(model.parameters(), lr=0.01)))
        seen = {}
        for step in range(1, STEPS + 1):
            tokens, targets = make_batch(CONFIG, 2, seed=step)
            losses = []
            for k, (model, opt) in enumerate(models):
                loss = model.loss(tokens, targets)
                if k == 1:
                    _straggle(step, ctx.world_size, ctx.rank)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach())
            assert torch.equal(losses[0], losses[1]), (step, losses)
            if step in MARKS:
                seen[step] = _counts()
        return seen
    finally:
        remat.distributed.set_replay_timeout(None)


def _loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _soak_pp_tp() -> dict[int, dict[str, int]]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    ctx = dist_context()
    pp_rank, tp_mesh = ctx.mesh.get_local_rank("pp"), ctx.mesh["tp"]
    pp_group = ctx.mesh["pp"].get_group()
    remat.distributed.set_replay_timeout(BOUND_S)
    try:
        runs = []
        for policy in (None, "full"):
            torch.manual_seed(0)
            module = GPTStage(GPT(CONFIG), [pp_rank], first=pp_rank == 0, last=pp_rank == 1)
            from torch.distributed.tensor.parallel import parallelize_module

            for block in module.layers.values():
                parallelize_module(block, tp_mesh, block_tp_plan())
            if policy is not None:
                remat.apply_remat(module, blocks=Block, policy=policy)
            stage = PipelineStage(module, pp_rank, 2, torch.device("cpu"), group=pp_group)
            schedule = Schedule1F1B(stage, n_microbatches=2, loss_fn=_loss_fn)
            runs.append((module, schedule, torch.optim.SGD(module.parameters(), lr=0.01)))
        seen = {}
        for step in range(1, STEPS + 1):
            tokens, targets = make_batch(CONFIG, 4, seed=step)
            losses = []
            for k, (_module, schedule, opt) in enumerate(runs):
                if k == 1:
                    _straggle(step, ctx.world_size, ctx.rank)
                out: list[torch.Tensor] = []
                if pp_rank == 0:
                    schedule.step(tokens)
                else:
                    schedule.step(target=targets, losses=out)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append([t.detach() for t in out])
            assert all(torch.equal(a, b) for a, b in zip(*losses, strict=True)), step
            if step in MARKS:
                seen[step] = _counts()
        return seen
    finally:
        remat.distributed.set_replay_timeout(None)


def _assert_flat(per_rank: list[dict[int, dict[str, int]]]) -> None:
    for rank, seen in enumerate(per_rank):
        first, mid, last = (seen[m] for m in MARKS)
        print(f"rank {rank}: step 1 {first}; step 100 {mid}; step {STEPS} {last}")
        assert last == mid, (rank, mid, last)
        for what, n in last.items():
            assert n <= first[what] + 2, (rank, what, first, last)


def test_tp_soak_keeps_nothing_that_grows():
    per_rank = run_distributed(
        _soak_tp, world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",), timeout=900
    )
    _assert_flat(per_rank)


def test_pp_x_tp_soak_keeps_nothing_that_grows():
    pytest.importorskip("torch.distributed.pipelining")
    per_rank = run_distributed(
        _soak_pp_tp, world_size=4, mesh_shape=(2, 2), mesh_dim_names=("pp", "tp"), timeout=900
    )
    _assert_flat(per_rank)
