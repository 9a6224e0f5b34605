"""The reference GPT under FSDP2 and tensor parallelism, on real gloo ranks."""

from __future__ import annotations

import torch
import torch.utils.checkpoint as tuc
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from remat_dist.models import GPT, GPTConfig, block_tp_plan, make_batch
from remat_dist.testing import DistContext, distributed

CONFIG = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=2)


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def _fsdp_step(ctx: DistContext, checkpoint: bool) -> tuple[float, dict]:
    model = GPT(CONFIG)
    for block in model.layers:
        fully_shard(block, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    if checkpoint:
        model.block_runner = lambda block, x, name: tuc.checkpoint(
            block, x, use_reentrant=False
        )
    tokens, targets = make_batch(CONFIG, 2, seed=ctx.rank)
    loss = model.loss(tokens, targets)
    loss.backward()
    return loss.item(), _full_grads(model)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("dp",))
def test_fsdp2_with_checkpointed_blocks_matches_plain_fsdp2(ctx: DistContext) -> None:
    loss_plain, grads_plain = _fsdp_step(ctx, checkpoint=False)
    loss_ckpt, grads_ckpt = _fsdp_step(ctx, checkpoint=True)
    assert loss_ckpt == loss_plain
    for name, g in grads_plain.items():
        assert torch.equal(grads_ckpt[name], g), name
    # FSDP averages over ranks: the same as one process on both ranks' batches.
    ref = GPT(CONFIG)
    for r in range(ctx.world_size):
        tokens, targets = make_batch(CONFIG, 2, seed=r)
        (ref.loss(tokens, targets) / ctx.world_size).backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads_plain[name], p.grad, msg=name)


@distributed(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
def test_tensor_parallel_plan_matches_the_unsharded_model(ctx: DistContext) -> None:
    ref = GPT(CONFIG)
    model = GPT(CONFIG)
    for block in model.layers:
        parallelize_module(block, ctx.mesh, block_tp_plan())
    tokens, targets = make_batch(CONFIG, 2, seed=0)  # the same batch on both ranks
    local_wq = model.layers[0].attention.wq.weight.to_local()
    assert local_wq.shape == (CONFIG.dim // 2, CONFIG.dim)  # half the heads
    torch.testing.assert_close(model(tokens), ref(tokens))
    model.loss(tokens, targets).backward()
    ref.loss(tokens, targets).backward()
    for name, g in _full_grads(model).items():
        torch.testing.assert_close(g, ref.get_parameter(name).grad, msg=name)
