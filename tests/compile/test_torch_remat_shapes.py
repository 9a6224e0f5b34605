"""The two torch_remat shapes that once failed to trace with ``fullgraph=True``.

* a checkpoint whose region wraps a custom ``torch.autograd.Function`` that names
  its saves with ``save_for_backward(ctx, {...})``, the region built inside the
  compiled function (``region(Fn.apply, ...)``: Dynamo cannot trace ``callable``
  on ``Function.apply``);
* the same region wrapper built eagerly, outside the compiled function.

Both trace in one graph (aot_eager and inductor), their gradients are bitwise
those of eager remat with aot_eager, and the partitioned graphs show the region's
decision as they do for a plain-function region: a save region's ``exp`` output is
among what the forward graph saves and the backward graph never computes ``exp``;
a recompute region's ``exp`` is recomputed in the backward graph.
"""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

import remat_dist as remat
from tests.compile._common import assert_grads_equal, fresh_dynamo

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
W = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) / 4


class _ExpMatmul(torch.autograd.Function):
    """``exp(x @ w)``, keeping its output (named) for its own backward."""

    @staticmethod
    def forward(ctx, x, w):
        y = torch.exp(x @ w)
        remat.save_for_backward(ctx, {"x": x, "w": w, "y": y})
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w, y = ctx.saved_tensors
        g = grad * y
        return g @ w.T, x.T @ g


def _plain(x, w):
    return torch.exp(x @ w)


_FNS = {"function": _ExpMatmul.apply, "plain": _plain}
_BUILT_EAGERLY = {
    (kind, recompute): remat.region(fn, "inner", recompute=recompute)
    for kind, fn in _FNS.items()
    for recompute in (False, True)
}


def _make(kind: str, recompute: bool, where: str):
    """The checkpointed function: the region built in its body or beforehand."""
    fn = _FNS[kind]
    built = _BUILT_EAGERLY[(kind, recompute)]

    def body(x, w):
        if where == "inside":
            inner = remat.region(fn, "inner", recompute=recompute)
        else:
            inner = built
        return torch.sin(inner(x, w)).square().sum()

    return remat.checkpoint(region_name="block")(body)


def _grads(run) -> dict[str, torch.Tensor]:
    x = X.clone().requires_grad_(True)
    w = W.clone().requires_grad_(True)
    run(x, w).backward()
    return {"x": x.grad, "w": w.grad}


@pytest.mark.parametrize("where", ["inside", "outside"])
@pytest.mark.parametrize("recompute", [False, True])
def test_function_region_aot_eager_bitwise(where, recompute):
    fresh_dynamo()
    eager = _grads(_make("function", recompute, where))
    compiled = torch.compile(
        _make("function", recompute, where), backend="aot_eager", fullgraph=True
    )
    assert_grads_equal(eager, _grads(compiled))


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_function_region_inductor(where):
    fresh_dynamo()
    eager = _grads(_make("function", False, where))
    compiled = torch.compile(
        _make("function", False, where), backend="inductor", fullgraph=True
    )
    assert_grads_equal(eager, _grads(compiled), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_one_graph_no_break(where):
    fresh_dynamo()
    x = X.clone().requires_grad_(True)
    w = W.clone().requires_grad_(True)
    explained = torch._dynamo.explain(_make("function", False, where))(x, w)
    assert explained.graph_count == 1, explained
    assert explained.graph_break_count == 0, explained.break_reasons


def _partitioned(kind: str, recompute: bool, where: str) -> tuple[int, int]:
    """``(exp outputs the forward graph saves, exp calls in the backward graph)``
    under the min-cut partitioner (inductor's and aot_eager's)."""
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=keep,
        bw_compiler=keep,
        partition_fn=min_cut_rematerialization_partition,
    )
    fresh_dynamo()
    _grads(
        torch.compile(_make(kind, recompute, where), backend=backend, fullgraph=True)
    )
    forward, backward = graphs

    def is_exp(node) -> bool:
        return node.op == "call_function" and node.target is torch.ops.aten.exp.default

    (out,) = forward.graph.find_nodes(op="output")
    saved = [a for a in out.args[0] if isinstance(a, torch.fx.Node) and is_exp(a)]
    return len(saved), sum(is_exp(n) for n in backward.graph.nodes)


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_decision_in_partitioned_graphs_as_for_plain_regions(where):
    for kind in ("plain", "function"):
        # save region: exp's output kept by the forward, never recomputed
        assert _partitioned(kind, False, where) == (1, 0), kind
        # recompute region: nothing of it kept, exp recomputed in backward
        assert _partitioned(kind, True, where) == (0, 1), kind
