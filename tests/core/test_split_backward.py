"""Split backward (zero-bubble pipeline schedules) through checkpoints that keep
save regions: ``stage_backward_input`` (one ``autograd.grad`` over the stage
inputs, keeping the graph), then ``stage_backward_weight`` (one ``autograd.grad``
per parameter group, each keeping no graph and each replaying the checkpoints it
reaches), from ``torch.distributed.pipelining._backward``, the calls the schedules
make.

The blocks are llama-style (RMSNorm, attention, an MLP whose ``w1``/``w3``/``w2``
linears are save regions, torchtitan's placement): their outputs are persisted for
the replays (the MLP's code and the residual add read them). Every gradient is
bitwise equal to the same calls without remat, and the persisted outputs, alive
through every call that may replay, are gone once the last one returns (weak
references to their storages, no ``gc``).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.multiprocessing.reductions import StorageWeakRef

import remat_dist as remat
from remat_dist import RematError

pipelining = pytest.importorskip("torch.distributed.pipelining._backward")

DIM, HEADS, HIDDEN = 16, 2, 32
BATCH, SEQ = 2, 8
SAVE_MLP = {f"feed_forward.{w}": "save" for w in ("w1", "w3", "w2")}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (
            nn.Linear(DIM, DIM, bias=False) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, HEADS, DIM // HEADS).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, DIM))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Stage(nn.Module):
    """Two blocks: a pipeline stage after the first (its input requires grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def _stage(policy) -> tuple[Stage, list]:
    """The stage (same weights whatever the policy) and weak references to the
    storages of its save regions' outputs, noted on forward."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        stage = Stage()
    kept: list[tuple[StorageWeakRef, int]] = []

    def note(module, args, out):
        if not remat.is_recomputing():
            storage = out.untyped_storage()
            kept.append((StorageWeakRef(storage), storage.nbytes()))

    for block in stage.layers:
        for w in (block.feed_forward.w1, block.feed_forward.w3, block.feed_forward.w2):
            w.register_forward_hook(note)
    if policy is not None:
        remat.apply_remat(stage, blocks=Block, policy=policy)
    return stage, kept


def _alive(kept: list) -> int:
    return sum(n for ref, n in kept if not ref.expired())


def _split_backward(policy, monkeypatch, hooks=None):
    """Forward (under ``hooks``), then the schedules' two calls; returns the input
    and weight gradients and the persisted bytes alive before each
    ``autograd.grad`` call and after each of the two calls."""
    stage, kept = _stage(policy)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, DIM, generator=g, requires_grad=True)
    dout = torch.randn(BATCH, SEQ, DIM, generator=g)
    timeline: list[tuple[str, int]] = []
    grad = torch.autograd.grad

    def noted_grad(*args, **kwargs):
        keep = kwargs.get("retain_graph", False)
        timeline.append(("keeps graph" if keep else "frees", _alive(kept)))
        return grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", noted_grad)
    gc.disable()  # what is freed must be freed by reference counting alone
    try:
        if hooks is None:
            out = stage(x)
        else:
            with hooks:
                out = stage(x)
        after_forward = _alive(kept)
        _, param_groups = pipelining.stage_backward_input(
            [out], [dout], [x], stage.parameters()
        )
        after_input = _alive(kept)
        pipelining.stage_backward_weight(stage.parameters(), param_groups)
        after_weight = _alive(kept)
    finally:
        gc.enable()
        monkeypatch.undo()
    grads = {n: p.grad for n, p in stage.named_parameters()}
    return x.grad, grads, (after_forward, timeline, after_input, after_weight)


def _identity_hooks():
    return remat.saved_tensors_hooks(lambda t: t, lambda t: t)


@pytest.mark.parametrize(
    ("policy", "hooks"),
    [(SAVE_MLP, None), ("full", None), (SAVE_MLP, _identity_hooks)],
    ids=["save_mlp", "full", "save_mlp_user_hooks"],
)
def test_split_backward_is_bitwise(policy, hooks, monkeypatch):
    ref_dx, ref_grads, _ = _split_backward(None, monkeypatch)
    dx, grads, _ = _split_backward(policy, monkeypatch, hooks and hooks())
    assert torch.equal(dx, ref_dx)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert grads[name] is not None, name
        assert torch.equal(grads[name], ref), name


def test_persisted_outputs_live_until_the_last_weight_pass(monkeypatch):
    *_, (after_forward, timeline, after_input, after_weight) = _split_backward(
        SAVE_MLP, monkeypatch
    )
    # w1, w3 (2 x 8 x 32 fp32) and w2 (2 x 8 x 16) of both blocks
    persisted = 2 * (2 + 2 + 1) * BATCH * SEQ * DIM * 4
    assert after_forward == persisted
    assert timeline[0] == ("keeps graph", persisted)  # the input pass
    weight_passes = timeline[1:]
    assert len(weight_passes) == 18  # one per parameter, each replaying again
    # every weight pass may replay: each starts with all of them
    assert weight_passes == [("frees", persisted)] * 18
    assert after_input == persisted
    assert after_weight == 0  # gone with the graph, which no pass could replay


def _one_block(fail: list):
    """A checkpointed block whose save region's output bare code reads on replay;
    ``fail`` (a list, emptied once used) makes one replay raise after serving it."""
    g = torch.Generator().manual_seed(2)
    w1 = (torch.randn(DIM, DIM, generator=g) / 4).requires_grad_()
    w2 = (torch.randn(DIM, DIM, generator=g) / 4).requires_grad_()

    def block(x):
        y = remat.region(lambda t: t @ w1, "proj", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        z = y.sin()
        if remat.is_recomputing() and fail:
            fail.pop()
            raise RuntimeError("replay interrupted")
        return z @ w2

    x = torch.randn(BATCH, DIM, generator=g, requires_grad=True)
    return remat.checkpoint(region_name="blk")(block), x, (w1, w2)


def test_a_second_replay_after_the_last_backward_freed_them_raises():
    """The last backward's replay (no graph kept, every node still holding the
    checkpoint's saved tensors to run) drops the persisted output as it serves it;
    if that backward then stops with an error, backward through the same graph
    again replays a second time and cannot have it: a clear error, not wrong
    values."""
    run, x, _ = _one_block(fail=[True])
    out = run(x)
    with pytest.raises(RuntimeError, match="replay interrupted"):
        out.sum().backward()
    with pytest.raises(RematError) as info:
        out.sum().backward()
    text = str(info.value)
    assert "needs output 0 of save region 'blk::proj' again" in text
    assert "an earlier backward replayed it and freed it" in text
    assert "retain_graph=True" in text


def test_a_backward_that_only_captures_a_node_does_not_free_them():
    """``autograd.grad`` with a checkpoint node's ``GradientEdge`` as its input keeps
    no graph but does not run that node, though torch says it will execute it (the
    node's children say otherwise): here the save region's own node, the only one
    left holding one of the checkpoint's saved tensors. A later backward from that
    edge runs it, replays again and needs the persisted output."""
    run, x, (w1, _) = _one_block(fail=[])
    out = run(x)
    sin_node = out.grad_fn.next_functions[0][0]
    proj_node = sin_node.next_functions[0][0]
    assert (sin_node.name(), proj_node.name()) == ("SinBackward0", "MmBackward0")
    (dy,) = torch.autograd.grad(out.sum(), [GradientEdge(proj_node, 0)])
    dx, dw1 = torch.autograd.grad([GradientEdge(proj_node, 0)], [x, w1], [dy])

    ref_run, ref_x, (ref_w1, _) = _one_block(fail=[])
    ref = ref_run.__wrapped__(ref_x)  # the block without the checkpoint
    ref_dx, ref_dw1 = torch.autograd.grad(ref.sum(), [ref_x, ref_w1])
    assert torch.equal(dx, ref_dx)
    assert torch.equal(dw1, ref_dw1)
