"""What cannot work under ``torch.compile`` fails at trace time, naming the option
(or construct) and the fix, with and without ``fullgraph`` (never a silent eager
fallback, never a wrong graph)."""

from __future__ import annotations

import pytest
import torch

import remat_dist as remat
from remat_dist import RematUsageError
from tests.compile._common import fresh_dynamo


def _raised_usage_error(excinfo: pytest.ExceptionInfo) -> RematUsageError:
    """The RematUsageError raised at trace time (Dynamo re-raises it wrapped, with
    the same message; the original is the context)."""
    e: BaseException | None = excinfo.value
    while e is not None and not isinstance(e, RematUsageError):
        e = e.__cause__ or e.__context__
    assert e is not None, repr(excinfo.value)
    assert str(e) in str(excinfo.value)  # the user sees the message as it is
    return e


def _compile_and_run(fn, fullgraph):
    fresh_dynamo()
    x = torch.randn(4, 4, requires_grad=True)
    return torch.compile(fn, backend="aot_eager", fullgraph=fullgraph)(x)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_saved_tensors_hooks_option(fullgraph):
    hooks = remat.saved_tensors_hooks(lambda t: t, lambda t: t)
    fn = remat.checkpoint(region_name="blk", saved_tensors_hooks=hooks)(torch.sin)
    with pytest.raises(Exception) as ei:
        _compile_and_run(fn, fullgraph)
    msg = str(_raised_usage_error(ei))
    assert "saved_tensors_hooks=" in msg and "Fix:" in msg and "'blk'" in msg


def test_determinism_check_option():
    fn = remat.checkpoint(region_name="blk", determinism_check="metadata_per_tensor")(torch.sin)
    with pytest.raises(Exception) as ei:
        _compile_and_run(fn, True)
    msg = str(_raised_usage_error(ei))
    assert "determinism_check='metadata_per_tensor'" in msg
    assert "determinism_check='metadata'" in msg


def test_nested_checkpoint():
    inner = remat.checkpoint(region_name="inner")(torch.sin)
    outer = remat.checkpoint(region_name="outer")(lambda x: inner(x) * 2)
    with pytest.raises(Exception) as ei:
        _compile_and_run(outer, True)
    msg = str(_raised_usage_error(ei))
    assert "nested checkpoints are not supported" in msg and "'outer'" in msg


def test_recompute_region_inside_save_region():
    def body(x):
        inner = remat.region(torch.cos, "inner", recompute=True)
        return remat.region(lambda t: inner(t) + 1, "outer", recompute=False)(x)

    fn = remat.checkpoint(region_name="blk")(body)
    with pytest.raises(Exception) as ei:
        _compile_and_run(fn, True)
    msg = str(_raised_usage_error(ei))
    assert "'blk::inner'" in msg and "nested inside save region 'blk::outer'" in msg


@pytest.mark.parametrize("fullgraph", [True, False])
def test_gradient_checkpoint_scope(fullgraph):
    def fn(x):
        with remat.gradient_checkpoint_scope():
            y = x.sin()
        return y * x

    with pytest.raises(Exception) as ei:
        _compile_and_run(fn, fullgraph)
    msg = str(_raised_usage_error(ei))
    assert "gradient_checkpoint_scope() is not supported under torch.compile" in msg
    assert "Fix:" in msg
    # eager: unchanged
    x = torch.randn(4, 4, requires_grad=True)
    fn(x).sum().backward()
    assert x.grad is not None


def test_state_hooks_accepted_and_not_needed():
    """recompute_state_hooks are accepted: the compiled backward replays the
    generator state AOTAutograd stashed (no Python runs on replay)."""
    calls = []

    class Hook:
        def snapshot(self):
            calls.append("snapshot")
            return None

        def restore(self, state):
            calls.append("restore")

    fn = remat.checkpoint(region_name="blk", recompute_state_hooks=(Hook(),))(
        lambda x: torch.nn.functional.dropout(x.sin(), 0.5)
    )
    fresh_dynamo()
    x = torch.randn(4, 4, requires_grad=True)
    torch.manual_seed(0)
    torch.compile(fn, backend="aot_eager", fullgraph=True)(x).sum().backward()
    assert calls == []
    # the recomputed dropout mask is the forward's: the gradient of the function
    # without checkpoint (aot_eager draws as eager does)
    ref = x.detach().clone().requires_grad_(True)
    torch.manual_seed(0)
    torch.nn.functional.dropout(ref.sin(), 0.5).sum().backward()
    assert torch.equal(x.grad, ref.grad)


@pytest.mark.parametrize("graph_break", [False, True])
def test_region_output_checked(graph_break):
    """A region returning a dict is refused, as in eager (at trace time, or when the
    body runs after a graph break)."""

    def body(t):
        if graph_break:
            torch._dynamo.graph_break()
        return remat.region(lambda u: {"a": u.sin()}, "r", recompute=True)(t)["a"]

    fn = remat.checkpoint(region_name="d")(body)
    with pytest.raises(Exception) as ei:
        _compile_and_run(fn, not graph_break)
    msg = str(_raised_usage_error(ei))
    assert "region 'd::r' returned a dict" in msg and "Fix:" in msg


def test_needs_tensor_outside_checkpoint_is_noop():
    """recompute_needs_tensor outside a checkpoint accepts anything, as in eager."""

    def fn(x):
        a, b = remat.region(lambda t: (t.sin(), None), "r", recompute=False)(x)
        remat.recompute_needs_tensor(a, b)
        return a

    assert _compile_and_run(fn, True).shape == (4, 4)
