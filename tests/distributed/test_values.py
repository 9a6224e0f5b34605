"""``determinism_check="values"`` on real gloo ranks: a replay that sends other
data through a collective with the same signature (a mixture-of-experts router
that picks other tokens on recompute, with the same split sizes) raises
``ReplayValueMismatchError`` on every rank at the end of backward; deterministic
replays (dropout, TP, FSDP2) never raise, over many steps, with gradients equal
bit for bit to the run without checkpointing."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import remat_dist as remat
from remat_dist.models import GPT, Block, GPTConfig, make_batch
from remat_dist.testing import DistContext, distributed

TOKENS, DIM = 8, 4
CONFIG = GPTConfig(vocab_size=32, seq_len=8, dim=16, n_heads=2, n_layers=2, dropout=0.1)
STEPS = 50


class MoE(torch.nn.Module):
    """Top-half routing over two experts, one per rank: each rank sends half of
    its tokens to each expert with ``all_to_all_single`` (fixed split sizes), the
    expert runs, and the tokens come back. ``permute_on_replay`` makes the router
    pick other tokens on recompute, with the same split sizes (what a
    nondeterministic top-k or a tie on a GPU does)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.router = torch.nn.Parameter(torch.randn(DIM, generator=g))
        g.manual_seed(1 + dist.get_rank())  # each rank's own expert
        self.expert = torch.nn.Parameter(torch.randn(DIM, DIM, generator=g) / 2)
        self.permute_on_replay = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = x @ self.router
        order = scores.argsort(stable=True)
        if self.permute_on_replay and remat.is_recomputing():
            order = order.roll(1)  # other tokens per expert, same counts
        send = x[order] * scores[order].sigmoid()[:, None]
        half = [TOKENS // 2, TOKENS // 2]
        group = dist.group.WORLD
        recv = funcol.all_to_all_single_autograd(send, half, half, group)
        back = funcol.all_to_all_single_autograd(
            (recv @ self.expert).tanh(), half, half, group
        )
        return torch.zeros_like(back).index_copy(0, order, back)


def _moe_step(moe: MoE, check: str | None) -> tuple[torch.Tensor, ...]:
    """One step of the block (checkpointed unless ``check`` is None); the grads."""
    x = torch.randn(
        TOKENS, DIM, generator=torch.Generator().manual_seed(10 + dist.get_rank())
    )
    x.requires_grad_(True)
    block = (
        moe
        if check is None
        else remat.checkpoint(region_name="moe", determinism_check=check)(moe)
    )
    out = block(x)
    moe.zero_grad(set_to_none=True)
    (out * out).sum().backward()
    return x.grad, moe.router.grad, moe.expert.grad


def _equal(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


@distributed(world_size=2)
def test_moe_permuted_routing_raises_on_every_rank(ctx: DistContext):
    moe = MoE()
    reference = _moe_step(moe, None)

    # without the check the permuted replay is silent and the gradients wrong
    moe.permute_on_replay = True
    assert not _equal(reference, _moe_step(moe, "metadata"))

    with pytest.raises(remat.errors.ReplayValueMismatchError) as ei:
        _moe_step(moe, "values")
    text = str(ei.value)
    assert isinstance(ei.value, remat.errors.CollectiveReplayError)
    assert "every rank of [0, 1]" in text and "ranks [0, 1]" in text, text
    assert "[rank 0] rank 0, checkpoint 'moe'" in text and "[rank 1] rank 1" in text, (
        text
    )
    assert "alltoall_base_" in text and "replayed collective 1 of 2" in text, text
    assert "saved tensor #" in text  # the saved tensors differ too, said after
    gathered = remat.distributed.all_gather_objects(text)  # no numpy needed
    assert gathered[0] == gathered[1]  # the same report on every rank

    # the group stayed aligned: the next step, deterministic, is clean and exact
    moe.permute_on_replay = False
    assert _equal(reference, _moe_step(moe, "values"))


@distributed(world_size=2)
def test_environment_turns_the_check_on(ctx: DistContext):
    moe = MoE()
    moe.permute_on_replay = True
    os.environ["REMAT_DIST_DETERMINISM_CHECK"] = "values"
    try:
        with pytest.raises(remat.errors.ReplayValueMismatchError, match="alltoall_base_"):
            _moe_step(moe, "metadata")
    finally:
        del os.environ["REMAT_DIST_DETERMINISM_CHECK"]
    _moe_step(moe, "metadata")  # off again: silent


@distributed(world_size=2)
def test_a_router_that_differs_on_one_rank(ctx: DistContext):
    # rank 1 routes other tokens on replay: its first all-to-all sends other data;
    # rank 0 then receives it, and its second all-to-all sends other data too.
    # Both raise the same report, the cause and its effect named by rank.
    moe = MoE()
    moe.permute_on_replay = ctx.rank == 1
    with pytest.raises(remat.errors.ReplayValueMismatchError) as ei:
        _moe_step(moe, "values")
    text = str(ei.value)
    assert "failed on ranks [0, 1]" in text, text
    lines = {
        line.split("]", 1)[0]: line
        for line in text.splitlines()
        if line.startswith("[rank")
    }
    assert "replayed collective 1 of 2" in lines["[rank 1"], text  # the cause
    assert "replayed collective 2 of 2" in lines["[rank 0"], text  # its effect


def _gpt(mesh, check: str | None, tp: bool) -> GPT:
    model = GPT(CONFIG)
    if check is not None:
        remat.apply_remat(model, blocks=Block, determinism_check=check)
    plan = remat.shard.reference_tp_plan() if tp else None
    remat.shard_model(model, mesh, blocks=Block, tp_plan=plan)
    return model


def _grads(model) -> dict[str, torch.Tensor]:
    return {
        n: getattr(p.grad, "_local_tensor", p.grad).clone()
        for n, p in model.named_parameters()
    }


def _train(ctx: DistContext, tp: bool) -> None:
    """50 steps with dropout and the value check: never a false alarm, and the
    first step's gradients equal those without checkpointing. Then a replay that
    computes other values on rank 1 is caught."""
    seed = 0 if tp else ctx.rank  # TP ranks see the same batch, FSDP2 ranks their own
    models = {}
    for check in (None, "values"):
        models[check] = model = _gpt(ctx.mesh, check, tp)
        torch.manual_seed(123)
        tokens, targets = make_batch(CONFIG, 2, seed=seed)
        model.loss(tokens, targets).backward()
    assert _equal(_grads(models[None]).values(), _grads(models["values"]).values())

    model = models["values"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        tokens, targets = make_batch(CONFIG, 2, seed=seed + 1000 * step)
        model.loss(tokens, targets).backward()
        opt.step()

    # rank 1's replay of block 0 feeds the MLP another input
    def nudge(module, args):
        if remat.is_recomputing() and ctx.rank == 1:
            return (args[0] * 1.5,)
        return None

    handle = model.layers[0].mlp.register_forward_pre_hook(nudge)
    try:
        loss = model.loss(*make_batch(CONFIG, 2, seed=seed))
        if tp or ctx.rank == 1:
            with pytest.raises(remat.errors.ReplayValueMismatchError) as ei:
                loss.backward()
            assert "checkpoint 'layers.0'" in str(ei.value) and "rank 1," in str(
                ei.value
            )
            if tp:  # at stake on the TP group: both ranks raise, naming rank 1
                assert "failed on ranks [1]" in str(ei.value)
                assert "allreduce_" in str(ei.value), str(ei.value)
        else:  # FSDP2: nothing at stake, the rank whose replay differs raises
            loss.backward()
    finally:
        handle.remove()
    ctx.barrier()


@pytest.mark.slow
@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tp_dropout_no_false_alarm(ctx: DistContext):
    _train(ctx, tp=True)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("dp",))
def test_fsdp2_dropout_no_false_alarm(ctx: DistContext):
    _train(ctx, tp=False)
