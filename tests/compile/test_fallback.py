"""A compiled checkpoint run without a traced region graph: a graph break in its body
(``fullgraph=False``: Dynamo runs ``torch.utils.checkpoint`` eagerly on the body)
and ``backend="eager"`` (the higher-order op interprets the traced subgraph under
torch's checkpoint at run time); compiled remat code inside an eager checkpoint
(refused).

Save regions must still be kept, not recomputed: the save region below calls a
counted custom op, whose kernel runs once per forward and once more per recompute
(torch's selective checkpoint serves a kept op's output from its storage without
running the kernel). Its bytes sit in that storage, which saved-tensor hooks (and so
``SavedBytesCounter``) do not see, so the count is what is compared here.
"""

from __future__ import annotations

import pytest
import torch

import remat_dist as remat
from remat_dist import RematUsageError
from remat_dist.core import _compile
from tests.compile._common import assert_grads_equal, fresh_dynamo
from tests.compile.test_errors import _raised_usage_error

CALLS: list[int] = []


@torch.library.custom_op("remat_dist_test::counted_tanh", mutates_args=())
def counted_tanh(x: torch.Tensor) -> torch.Tensor:
    CALLS.append(1)
    return torch.tanh(x)


@counted_tanh.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return grad * (1 - y * y)


counted_tanh.register_autograd(_backward, setup_context=_setup)

W = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) / 3
X = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))


def _make(recompute: bool, graph_break: bool):
    w = torch.nn.Parameter(W.clone())

    def body(x):
        h = remat.region(lambda t: counted_tanh(t @ w), "attn", recompute=recompute)(
            x.sin()
        )
        remat.recompute_needs_tensor(h)
        if graph_break:
            torch._dynamo.graph_break()
        return (h * x).cos()

    return remat.checkpoint(region_name="blk")(body), w


def _calls_and_grads(fn, w):
    """Kernel runs of the counted op in forward + backward, and the gradients."""
    x = X.clone().requires_grad_(True)
    CALLS.clear()
    fn(x).square().sum().backward()
    return len(CALLS), {"x": x.grad, "w": w.grad}


def _compiled(fn, how):
    if how == "graph_break":
        return torch.compile(fn, backend="aot_eager")
    return torch.compile(fn, backend="eager", fullgraph=True)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("how", ["graph_break", "eager_backend"])
def test_save_region_kept_without_graph(how, recompute):
    """Eager remat runs a save region's op once and a recompute region's twice; so
    does the compiled checkpoint, with the same gradients (bitwise: eager ops)."""
    fresh_dynamo()
    ref_calls, ref = _calls_and_grads(*_make(recompute, False))
    fn, w = _make(recompute, how == "graph_break")
    calls, got = _calls_and_grads(_compiled(fn, how), w)
    assert ref_calls == (2 if recompute else 1)
    assert calls == ref_calls
    assert_grads_equal(ref, got)
    assert _compile._fallback.get() is None  # nothing leaks past the call


def test_policy_refuses_unannotated_run():
    """A backend that ran the checkpoint without the node annotations (none does in
    torch 2.13) is refused rather than recompute the save regions."""
    with pytest.raises(RematUsageError, match='backend="aot_eager" or "inductor"'):
        _compile._policy(None, torch.ops.aten.sin.default, torch.ones(1))


def _run_graph_break(fn):
    fresh_dynamo()
    x = torch.randn(4, 4, requires_grad=True)
    return torch.compile(fn, backend="aot_eager")(x)


def test_graph_break_nested_checkpoint_refused():
    inner = remat.checkpoint(region_name="inner")(torch.sin)

    def body(t):
        torch._dynamo.graph_break()
        return inner(t) * 2

    with pytest.raises(RematUsageError, match="nested checkpoints are not supported"):
        _run_graph_break(remat.checkpoint(region_name="outer")(body))


def test_graph_break_recompute_inside_save_refused():
    def body(t):
        torch._dynamo.graph_break()
        inner = remat.region(torch.cos, "inner", recompute=True)
        return remat.region(lambda u: inner(u) + 1, "outer", recompute=False)(t)

    with pytest.raises(RematUsageError, match="nested inside save region 'blk::outer'"):
        _run_graph_break(remat.checkpoint(region_name="blk")(body))


def _break_in_mlp(monkeypatch):
    """A graph break in every GPT MLP's forward; a small block config and input."""
    from remat_dist.models import MLP, GPTConfig

    forward = MLP.forward

    def breaking(self, x):
        torch._dynamo.graph_break()
        return forward(self, x)

    monkeypatch.setattr(MLP, "forward", breaking)
    cfg = GPTConfig(seq_len=16, dim=32, n_heads=4, dropout=0.0)
    return cfg, torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))


def test_block_graph_break_equals_eager_remat(monkeypatch):
    """A GPT block with a graph break in its MLP, attention kept: the same grads as
    eager remat."""
    from remat_dist.models import Block
    from tests.compile._common import step

    cfg, x = _break_in_mlp(monkeypatch)
    grads = []
    for compiled in (False, True):
        fresh_dynamo()
        torch.manual_seed(0)
        block = Block(cfg)
        remat.apply_remat(torch.nn.Sequential(block), blocks=Block,
                          policy={"attention": "save"})
        if compiled:
            block.compile(backend="aot_eager")
        grads.append(step(block, x, lambda y: y.square().sum())[1])
    assert_grads_equal(*grads)


def test_graph_break_under_saved_tensor_hooks_keeps_save_regions_out_of_them(monkeypatch):
    """After a graph break torch's selective checkpoint runs for real, here under
    ``SavedBytesCounter``'s saved-tensor hooks: the save region's kept tensors
    stay in the checkpoint's storage, out of the hooks, as on every supported
    torch. torch 2.14 and newer warn (``FutureWarning``) unless the checkpoint
    says so itself, since a later release routes them through the hooks by
    default; remat_dist says so: no warning, and the bytes the hooks see and the
    gradients equal those of the first compiled step."""
    import warnings

    from remat_dist.models import Block
    from tests.compile._common import step

    cfg, x = _break_in_mlp(monkeypatch)
    fresh_dynamo()
    torch.manual_seed(0)
    block = Block(cfg)
    remat.apply_remat(torch.nn.Sequential(block), blocks=Block, policy={"attention": "save"})
    block.compile(backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        runs = [step(block, x, lambda y: y.square().sum()) for _ in range(2)]
    (bytes0, grads0), (bytes1, grads1) = runs
    assert bytes0 == bytes1 > 0
    assert_grads_equal(grads0, grads1)


def test_compiled_remat_inside_eager_checkpoint_refused():
    """A compiled function with a save region (or a checkpoint) called inside an
    eager checkpoint is refused at trace time (the eager record cannot see it)."""

    def sub(t):
        return remat.region(torch.sin, "attn", recompute=False)(t) * 2

    for inner in (sub, remat.checkpoint(region_name="inner")(torch.sin)):
        fresh_dynamo()
        compiled = torch.compile(inner, backend="aot_eager")
        outer = remat.checkpoint(region_name="outer")(
            lambda t, compiled=compiled: compiled(t) + 1
        )
        with pytest.raises(Exception) as ei:
            outer(torch.randn(4, requires_grad=True))
        msg = str(_raised_usage_error(ei))
        assert "inside the eager checkpoint 'outer'" in msg and "Fix:" in msg


def test_graph_break_is_recomputing():
    """After a graph break the body's Python runs again in backward: there,
    is_recomputing() is True, as on an eager replay."""
    seen = []

    def body(t):
        seen.append(remat.is_recomputing())
        torch._dynamo.graph_break()
        return t.sin().cos()

    _run_graph_break(remat.checkpoint(region_name="blk")(body)).sum().backward()
    assert seen == [False, True]
    assert not remat.is_recomputing()


@pytest.mark.parametrize("how", ["graph_break", "eager_backend"])
def test_dropout_equals_eager_remat(how):
    """Dropout in and out of a save region: the generator state is restored for the
    recompute (by torch's checkpoint after a graph break, by remat's run-time
    contexts with backend="eager", which torch runs with preserve_rng_state=False),
    so the gradients are eager remat's."""

    def body(t):
        h = remat.region(lambda u: torch.nn.functional.dropout(u.sin(), 0.5), "drop",
                         recompute=False)(t)
        remat.recompute_needs_tensor(h)
        if how == "graph_break":
            torch._dynamo.graph_break()
        return torch.nn.functional.dropout(h * t, 0.5).cos()

    fn = remat.checkpoint(region_name="blk")(body)
    grads = []
    for f in (fn, _compiled(fn, how)):
        fresh_dynamo()
        x = X.clone().requires_grad_(True)
        torch.manual_seed(5)
        f(x).square().sum().backward()
        grads.append({"x": x.grad})
    assert_grads_equal(*grads)


class _ScaleHook:
    """A user state hook over a Python value the body reads."""

    def __init__(self, state):
        self.state = state

    def snapshot(self):
        return self.state["scale"]

    def restore(self, value):
        self.state["scale"] = value


@pytest.mark.parametrize("graph_break", [False, True])
def test_user_state_hooks_replay_compiled(graph_break):
    """A user's recompute_state_hooks keep a Python value aligned for the replay:
    after a graph break the body's Python runs again in backward and the hooks are
    restored around it as in eager remat; without one the compiled backward runs
    no Python. Either way the gradients are eager remat's, not those of the value
    changed after forward."""
    state = {"scale": 1.0}

    def body(t):
        h = t.sin() * state["scale"]
        if graph_break:
            torch._dynamo.graph_break()
        return h.cos()

    fn = remat.checkpoint(region_name="blk", recompute_state_hooks=[_ScaleHook(state)])(body)
    grads = []
    for f in (fn, torch.compile(fn, backend="aot_eager")):
        fresh_dynamo()
        state["scale"] = 1.0
        x = X.clone().requires_grad_(True)
        loss = f(x).square().sum()
        state["scale"] = 5.0
        loss.backward()
        assert state["scale"] == 5.0
        grads.append({"x": x.grad})
    assert_grads_equal(*grads)
