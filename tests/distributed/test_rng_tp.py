"""Tensor parallelism on 2 gloo ranks: dropout replays bit-identically on every rank.

A small attention + MLP block, q/k/v and fc1 ``ColwiseParallel``, proj and fc2
``RowwiseParallel`` on ``init_device_mesh("cpu", (2,))``, each block in a
``remat_dist.checkpoint``. Dropout draws on sharded data (attention probabilities
of this rank's heads, the MLP's hidden units, inside a save region) and on
replicated data (the residual branches, and the block output after the save
region). Every mask is recorded, so the tests compare what each rank drew on
forward, on replay and without remat.

On CPU, torch 2.13's DTensor has no offset RNG tracker, so a sharded dropout draws
from the rank's own CPU generator: with equal seeds every shard gets the same local
mask. The Megatron-style fix is a per-rank named stream for sharded dropout, kept
aligned by a :class:`GeneratorStateHook`; the ``named`` cases check that.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import remat_dist as remat
from remat_dist.core import _record
from remat_dist.distributed import default_state_hooks, install_default_provider
from remat_dist.distributed._rng import DTensorRNGStateHook, GeneratorStateHook
from remat_dist.testing import DistContext, distributed

DIM, HEADS, HIDDEN, SEQ, BATCH, BLOCKS = 16, 4, 32, 6, 2, 2
SHARDED = ("attn.probs", "mlp.act")  # per-rank slices of the data
REPLICATED = ("attn.resid", "block.out")  # the same data on every rank

_masks: list[tuple[str, bool, torch.Tensor]] = []
"""(name, drawn during replay, keep-mask) for every dropout call, in order."""


def _dropout(
    x: torch.Tensor, name: str, p: float, gen: torch.Generator | None
) -> torch.Tensor:
    keep = torch.empty_like(x).bernoulli_(1 - p, generator=gen)
    _masks.append((name, remat.is_recomputing(), keep))
    return x * keep / (1 - p)


class Attention(nn.Module):
    def __init__(self, stream: list[torch.Generator | None]) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.k = nn.Linear(DIM, DIM, bias=False)
        self.v = nn.Linear(DIM, DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.stream = stream  # [generator for sharded dropout], set per run

    def forward(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        b, t, _ = x.shape
        hd = DIM // HEADS
        q, k, v = self.q(x), self.k(x), self.v(x)  # local: this rank's heads
        heads = q.shape[-1] // hd

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, heads, hd).transpose(1, 2)

        q, k, v = split(q), split(k), split(v)
        att = (q @ k.transpose(-2, -1) / math.sqrt(hd)).softmax(-1)
        att = _dropout(att, f"{tag}attn.probs", 0.25, self.stream[0])
        y = (att @ v).transpose(1, 2).reshape(b, t, heads * hd)
        return self.proj(y)  # all-reduce: replicated again


class MLP(nn.Module):
    def __init__(self, stream: list[torch.Generator | None]) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.stream = stream
        # Keep the whole MLP (its DTensor matmuls too) as the save region.
        self.save_whole = False

    def forward(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        def act(h: torch.Tensor) -> torch.Tensor:
            return _dropout(
                torch.nn.functional.gelu(h), f"{tag}mlp.act", 0.25, self.stream[0]
            )

        if self.save_whole:
            whole = remat.region(
                lambda z: self.fc2(act(self.fc1(z))), "mlp", recompute=False
            )
            out = whole(x)
            remat.recompute_needs_tensor(out)
            return out
        # A save region that draws random numbers: skipped on replay, so the RNG
        # must be restored to its state after it before the code below replays.
        h = remat.region(act, "mlp.act", recompute=False)(self.fc1(x))
        remat.recompute_needs_tensor(h)
        return self.fc2(h)


class Block(nn.Module):
    def __init__(self, index: int, stream: list[torch.Generator | None]) -> None:
        super().__init__()
        self.tag = f"{index}."
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attention, self.mlp = Attention(stream), MLP(stream)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.tag
        x = x + _dropout(self.attention(self.ln1(x), t), f"{t}attn.resid", 0.1, None)
        x = x + self.mlp(self.ln2(x), t)
        return _dropout(x, f"{t}block.out", 0.1, None)


TP_PLAN = {
    "attention.q": "colwise",
    "attention.k": "colwise",
    "attention.v": "colwise",
    "attention.proj": "rowwise",
    "mlp.fc1": "colwise",
    "mlp.fc2": "rowwise",
}


def _build(
    mesh: Any, save_whole_mlp: bool = False
) -> tuple[nn.ModuleList, list[torch.Generator | None]]:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    stream: list[torch.Generator | None] = [None]
    torch.manual_seed(0)  # the same full weights on every rank
    blocks = nn.ModuleList(Block(i, stream) for i in range(BLOCKS))
    plan = {name: styles[style]() for name, style in TP_PLAN.items()}
    for blk in blocks:
        blk.mlp.save_whole = save_whole_mlp
        parallelize_module(blk, mesh, plan)
    return blocks, stream


def _run(
    blocks: nn.ModuleList, mode: str, hooks: tuple[Any, ...] | None = None
) -> tuple[list[torch.Tensor], list[tuple[str, bool, torch.Tensor]]]:
    """One forward + backward; returns the local gradients and the masks drawn."""
    _masks.clear()
    for p in blocks.parameters():
        p.grad = None
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(5))
    x.requires_grad_()
    for i, blk in enumerate(blocks):
        if mode == "remat":
            x = remat.checkpoint(
                region_name=f"layers.{i}", recompute_state_hooks=hooks
            )(blk)(x)
        else:
            x = blk(x)
    x.pow(2).sum().backward()
    grads = [
        p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        for p in blocks.parameters()
    ]
    return [g.clone() for g in grads], list(_masks)


def _seed(
    stream: list[torch.Generator | None], named: torch.Generator | None, rank: int
) -> None:
    torch.manual_seed(1234)  # same on every rank: replicated dropout must agree
    if named is not None:
        named.manual_seed(777 + rank)  # per rank: sharded dropout must not repeat
    stream[0] = named


def _forward_masks(
    masks: list[tuple[str, bool, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    out = {name: m for name, replay, m in masks if not replay}
    assert len(out) == sum(not replay for _, replay, _ in masks), "a name drew twice"
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _check_against_reference(
    ref: tuple[list[torch.Tensor], list[Any]], got: tuple[list[torch.Tensor], list[Any]]
) -> None:
    ref_grads, ref_masks = ref
    grads, masks = got
    assert _same(ref_grads, grads), "gradients differ from the run without remat"
    fwd = _forward_masks(masks)
    ref_fwd = _forward_masks(ref_masks)
    assert fwd.keys() == ref_fwd.keys()
    for name, m in fwd.items():
        assert torch.equal(m, ref_fwd[name]), f"forward mask {name} differs"
    replayed = [(name, m) for name, replay, m in masks if replay]
    assert {n for n, _ in replayed} == {n for n in fwd if not n.endswith("mlp.act")}
    for name, m in replayed:
        assert torch.equal(m, fwd[name]), f"replay drew another mask for {name}"


def _check_cross_rank(ctx: DistContext, masks: list[Any], sharded_agree: bool) -> None:
    fwd = _forward_masks(masks)
    every = ctx.all_gather_object(fwd)
    for name in fwd:
        same = torch.equal(every[0][name], every[1][name])
        if name.endswith(REPLICATED):
            assert same, f"replicated dropout {name} differs between ranks"
        else:
            assert name.endswith(SHARDED)
            assert same == sharded_agree, f"sharded dropout {name}: ranks agree={same}"


@distributed(world_size=2, mesh_shape=(2,))
def test_tp_default_hooks_via_provider_replay_bitwise(ctx: DistContext) -> None:
    """recompute_state_hooks=None with the distributed provider installed."""
    blocks, stream = _build(ctx.mesh)
    saved = _record._SEAMS.hooks_provider
    try:
        install_default_provider()
        # A gloo-only group is a CPU run: the default set is the CPU generator.
        (hook,) = _record._SEAMS.hooks_provider()
        assert hook.generator is torch.default_generator
        _seed(stream, None, ctx.rank)
        ref = _run(blocks, "plain")
        _seed(stream, None, ctx.rank)
        got = _run(blocks, "remat", hooks=None)
    finally:
        _record.set_default_state_hooks_provider(saved)
    _check_against_reference(ref, got)
    # One CPU generator, seeded alike: each shard gets the same local mask, with
    # remat exactly as without it (DTensor keeps no per-shard offset on CPU).
    _check_cross_rank(ctx, ref[1], sharded_agree=True)
    _check_cross_rank(ctx, got[1], sharded_agree=True)

    _seed(stream, None, ctx.rank)
    off = _run(blocks, "remat", hooks=())
    assert not _same(ref[0], off[0]), "without state hooks the replay should differ"


@pytest.mark.parametrize("save_whole_mlp", [False, True])
@distributed(world_size=2, mesh_shape=(2,))
def test_tp_named_stream_per_rank_replays_bitwise(
    ctx: DistContext, save_whole_mlp: bool
) -> None:
    """Megatron-style: a per-rank generator for sharded dropout, one hook for it."""
    blocks, stream = _build(ctx.mesh, save_whole_mlp)
    named = torch.Generator()
    _seed(stream, named, ctx.rank)
    ref = _run(blocks, "plain")
    _check_cross_rank(ctx, ref[1], sharded_agree=False)

    hooks = (*default_state_hooks(ctx.device), GeneratorStateHook(named))
    _seed(stream, named, ctx.rank)
    got = _run(blocks, "remat", hooks=hooks)
    _check_against_reference(ref, got)
    _check_cross_rank(ctx, got[1], sharded_agree=False)

    # The default set alone leaves the named stream unaligned; no hooks at all
    # leaves everything unaligned. Both must show up in the gradients.
    _seed(stream, named, ctx.rank)
    assert not _same(
        ref[0], _run(blocks, "remat", hooks=default_state_hooks(ctx.device))[0]
    )
    _seed(stream, named, ctx.rank)
    assert not _same(ref[0], _run(blocks, "remat", hooks=())[0])


def _dtensor_body(mesh: Any, w: torch.Tensor):
    from torch.distributed.tensor import DTensor, Shard

    def body(x: torch.Tensor) -> torch.Tensor:
        h = DTensor.from_local(x, mesh, [Shard(0)]) * w  # this rank's rows
        h = torch.nn.functional.dropout(h, 0.5)  # a DTensor random op
        return torch.nn.functional.dropout(h.tanh(), 0.5).to_local()

    return body


@pytest.mark.parametrize("which", ["dtensor_hook", "default"])
@distributed(world_size=2, mesh_shape=(2,))
def test_dtensor_random_ops_on_cpu_mesh_replay_bitwise(
    ctx: DistContext, which: str
) -> None:
    """DTensor dropout on a CPU mesh: no tracker; the CPU generator is what counts."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor import _random as dt_random

    torch.manual_seed(0)
    w = nn.Parameter(distribute_tensor(torch.randn(8, 8), ctx.mesh, [Shard(0)]))
    body = _dtensor_body(ctx.mesh, w)
    hooks = (
        (DTensorRNGStateHook(device_type=ctx.mesh.device_type),)
        if which == "dtensor_hook"
        else default_state_hooks(ctx.device)
    )

    def grads(run: Any) -> torch.Tensor:
        torch.manual_seed(99)
        w.grad = None
        run(torch.ones(4, 8)).pow(2).sum().backward()
        return w.grad.to_local().clone()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "DTensor random operators may not ... on cpu"
        ref = grads(body)
        assert dt_random._rng_tracker is None  # torch 2.13 builds none for CPU meshes
        got = grads(
            remat.checkpoint(region_name="dt", recompute_state_hooks=hooks)(body)
        )
        off = grads(remat.checkpoint(region_name="dt", recompute_state_hooks=())(body))
    assert torch.equal(ref, got)
    assert not torch.equal(ref, off)
