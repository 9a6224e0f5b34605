"""torch_remat 0.2.x drop-in: the parts of its API that torch_remat code passes or
reads, and running such code unchanged under ``import torch_remat as remat``."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
from torch import nn

import remat_dist
import remat_dist.compat
from remat_dist.report._trace import OpTrace, ScopeTrace

remat = remat_dist


# --- preserve_rng_state -----------------------------------------------------------


def test_preserve_rng_state_false_is_accepted_and_dropout_still_replays():
    torch.manual_seed(0)
    x = torch.randn(16, 16, requires_grad=True)

    def block(t):
        return nn.functional.dropout(t.sin(), p=0.5).cos().sum()

    torch.manual_seed(1)
    block(x).backward()
    expected, x.grad = x.grad, None

    torch.manual_seed(1)
    run = remat.checkpoint(region_name="layers.0", preserve_rng_state=False)(block)
    run(x).backward()
    # default state hooks replay the CPU generator: same dropout mask on replay
    assert torch.equal(x.grad, expected)


def test_preserve_rng_state_true_raises_not_implemented_naming_region_and_fix():
    with pytest.raises(NotImplementedError) as info:
        remat.checkpoint(region_name="layers.3", preserve_rng_state=True)
    assert isinstance(info.value, remat.RematUsageError)  # like every other misuse
    msg = str(info.value)
    assert "checkpoint(region_name='layers.3')" in msg
    assert "recompute_state_hooks=remat_dist.distributed.default_state_hooks()" in msg
    assert "(remat_dist.distributed.CPURNGStateHook(),)" in msg


def test_preserve_rng_state_not_a_bool_is_a_usage_error():
    with pytest.raises(remat.RematUsageError, match="layers.0.*must be False"):
        remat.checkpoint(region_name="layers.0", preserve_rng_state="no")


def test_unknown_option_lists_every_keyword_checkpoint_takes():
    with pytest.raises(remat.RematUsageError) as info:
        remat.checkpoint(region_name="layers.0", use_reentrant=True)
    msg = str(info.value)
    for name in (
        "region_name", "recompute_state_hooks", "saved_tensors_hooks",
        "determinism_check", "preserve_rng_state", "collectives",
    ):
        assert name in msg.split("Supported:")[1], msg


def test_misuse_raises_what_torch_remat_raises_too():
    # torch_remat: checkpoint() takes keywords only (TypeError); nesting is
    # NotImplementedError. Both stay RematUsageErrors naming the fix here.
    with pytest.raises(TypeError) as info:
        remat.checkpoint(torch.sin)
    assert isinstance(info.value, remat.RematUsageError)
    assert "region_name='layers.0'" in str(info.value)

    inner = remat.checkpoint(region_name="inner")(torch.sin)
    outer = remat.checkpoint(region_name="outer")(lambda t: inner(t).cos())
    with pytest.raises(NotImplementedError) as info:
        outer(torch.randn(3, requires_grad=True))
    assert isinstance(info.value, remat.RematUsageError)
    assert "nested checkpoints are not supported" in str(info.value)


# --- trace.entries ------------------------------------------------------------------


def test_trace_entries_have_torch_remats_shape():
    def block(x):
        with remat.name_scope("attn"):
            x = remat.region(torch.sin, "sin", recompute=False)(x)
        return remat.region(torch.cos, "cos", recompute=True)(x)

    scoped = remat.trace_scope(
        remat.checkpoint(region_name="layers.0")(block), "scope", metadata="test_flag"
    )
    x = torch.randn(4, requires_grad=True)
    with remat.collect_trace() as trace:
        scoped(x).sum().backward()  # the replay adds nothing
        remat.region(torch.tanh, "outside", recompute=True)(x)
    assert trace.entries == [
        ScopeTrace(
            "scope",
            "test_flag",
            [OpTrace("attn/sin", recompute=False), OpTrace("cos", recompute=True)],
        ),
        OpTrace("outside", recompute=True),
    ]
    # the checkpoint level stays where remat_dist shows it
    assert [n.kind for n in trace.roots[0].children] == ["checkpoint"]
    assert ("scope/layers.0/attn/sin", "save") in trace.decisions()


# --- fresh requires-grad leaves ---------------------------------------------------


@pytest.mark.parametrize("recompute", [True, False])
def test_region_returning_fresh_grad_leaf_is_refused(recompute):
    def block(x):
        y = remat.region(
            lambda t: torch.zeros(3, requires_grad=True), "alloc", recompute=recompute
        )(x)
        return (x * y).sum()

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(remat.RematUsageError) as info:
        remat.checkpoint(region_name="layers.1")(block)(x)
    msg = str(info.value)
    assert "region 'layers.1::alloc'" in msg
    assert f"recompute={recompute}" in msg
    assert "a fresh leaf (no grad_fn) created inside the region" in msg
    assert "Fix: create it outside the checkpoint" in msg


@pytest.mark.parametrize("recompute", [True, False])
def test_region_returning_its_argument_or_a_parameter_is_allowed(recompute):
    lin = nn.Linear(3, 3)

    def block(x):
        a = remat.region(lambda t: t, "same", recompute=recompute)(x)
        w = remat.region(lambda: lin.weight, "param", recompute=recompute)()
        if not recompute:
            remat.recompute_needs_tensor(a, w)
        return (a @ w).sin().sum()

    x = torch.randn(2, 3, requires_grad=True)
    (x @ lin.weight).sin().sum().backward()
    expected = (x.grad, lin.weight.grad)
    x.grad = lin.weight.grad = None
    remat.checkpoint(region_name="layers.2")(block)(x).backward()
    assert torch.allclose(x.grad, expected[0])
    assert torch.allclose(lin.weight.grad, expected[1])


# --- import torch_remat as remat --------------------------------------------------


@pytest.fixture
def no_torch_remat():
    """No torch_remat in sys.modules during the test; what was there is put back."""
    before = sys.modules.pop("torch_remat", None)
    yield
    sys.modules.pop("torch_remat", None)
    if before is not None:
        sys.modules["torch_remat"] = before


TORCHTITAN_STYLE = '''
import torch
from torch import nn

import torch_remat as remat


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = nn.Linear(dim, dim)
        self.ffn_norm = nn.LayerNorm(dim)
        self.moe = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states):
        x = self.attention_norm(hidden_states)
        attn = remat.region(self.attention, "attention", recompute=False)(x)
        remat.recompute_needs_tensor(attn)
        hidden_states = hidden_states + attn
        x = self.ffn_norm(hidden_states)
        moe = remat.region(self.moe, "moe", recompute=False)(x)
        remat.recompute_needs_tensor(moe)
        return hidden_states + moe


class RematAC(nn.Module):
    """Shaped like torchtitan's wrapper: one checkpoint per block."""

    def __init__(self, block, name):
        super().__init__()
        self.block = block
        self.name = name

    def forward(self, *args, **kwargs):
        return remat.checkpoint(
            region_name=self.name,
            determinism_check="default",
            preserve_rng_state=False,
        )(self.block)(*args, **kwargs)
'''


def _load_torchtitan_style(tmp_path, monkeypatch):
    (tmp_path / "titan_like.py").write_text(TORCHTITAN_STYLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "titan_like", raising=False)
    return importlib.import_module("titan_like")


@pytest.mark.slow
def test_not_aliased_by_default():
    code = (
        "import sys, remat_dist, remat_dist.compat\n"
        "assert 'torch_remat' not in sys.modules, sys.modules['torch_remat']\n"
        "try:\n"
        "    import torch_remat\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    assert torch_remat is not remat_dist\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_torchtitan_style_code_runs_on_the_alias(no_torch_remat, tmp_path, monkeypatch):
    assert remat_dist.compat.install_torch_remat_alias() is remat_dist
    assert remat_dist.compat.install_torch_remat_alias() is remat_dist  # idempotent
    titan = _load_torchtitan_style(tmp_path, monkeypatch)
    assert titan.remat is remat_dist

    torch.manual_seed(0)
    blocks = [titan.Block(8) for _ in range(2)]
    x = torch.randn(4, 8, requires_grad=True)

    def grads(wrap):
        h = x
        for i, b in enumerate(blocks):
            h = (titan.RematAC(b, f"layers.{i}") if wrap else b)(h)
        h.square().sum().backward()
        out = [x.grad, *(p.grad for b in blocks for p in b.parameters())]
        x.grad = None
        for b in blocks:
            b.zero_grad(set_to_none=True)
        return out

    expected = grads(wrap=False)
    with remat.collect_trace() as trace:
        got = grads(wrap=True)
    assert [(e.name, e.recompute) for e in trace.entries] == [
        ("attention", False), ("moe", False), ("attention", False), ("moe", False),
    ]
    for g, e in zip(got, expected, strict=True):
        assert torch.allclose(g, e, atol=1e-6)

    remat_dist.compat.uninstall_torch_remat_alias()
    assert "torch_remat" not in sys.modules


def _fake_real_torch_remat(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "torch_remat"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    return pkg


def test_installed_torch_remat_is_never_shadowed_silently(
    no_torch_remat, tmp_path, monkeypatch
):
    pkg = _fake_real_torch_remat(tmp_path, monkeypatch)
    with pytest.raises(remat.RematError) as info:
        remat_dist.compat.install_torch_remat_alias()
    msg = str(info.value)
    assert "a real torch_remat is installed" in msg and str(pkg) in msg
    assert "force=True" in msg
    assert "torch_remat" not in sys.modules

    real = importlib.import_module("torch_remat")
    assert real.REAL
    with pytest.raises(remat.RematError, match="already imported"):
        remat_dist.compat.install_torch_remat_alias()
    assert sys.modules["torch_remat"] is real
    remat_dist.compat.uninstall_torch_remat_alias()  # leaves a real one alone
    assert sys.modules["torch_remat"] is real

    assert remat_dist.compat.install_torch_remat_alias(force=True) is remat_dist
    assert sys.modules["torch_remat"] is remat_dist
    remat_dist.compat.uninstall_torch_remat_alias()  # puts the replaced one back
    assert sys.modules["torch_remat"] is real


# --- keyword and argument names -----------------------------------------------------


def test_torch_remats_keyword_names_and_report_call_shapes():
    import io

    w = torch.randn(4, 4, requires_grad=True)

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            remat.save_for_backward(ctx, saved={"x": x})
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    seen = []

    def block(x):
        y = remat.region(function=Square.apply, name="sq", recompute=False)(x @ w)
        remat.recompute_needs_tensor(y)
        assert not remat.is_placeholder(tensor=y)
        return y.sin()

    traced = remat.trace_scope(function=block, name="scope")
    hooks = remat.saved_tensors_hooks(
        pack_hook=lambda t: seen.append(t.shape) or t, unpack_hook=lambda t: t
    )
    with hooks:
        loss = remat.checkpoint(region_name="layers.0")(traced)(torch.randn(2, 4)).sum()
    assert seen
    # torch_remat's report signatures: roots= (a tensor or a list), file first
    text = remat.format_saved_tensors_report(roots=loss)
    assert text == remat.format_saved_tensors_report(roots=[loss])
    assert text == remat.format_saved_tensors_report(loss)
    assert remat.report.saved_tensors_summary(roots=loss) == remat.report.saved_tensors_summary(loss)
    out = io.StringIO()
    remat.print_saved_tensors_report(roots=loss, file=out)
    assert out.getvalue() == text + "\n"
    out = io.StringIO()
    remat.print_current_memory_report(out)  # outside a checkpoint: says so
    assert out.getvalue().strip() == remat.format_current_memory_report(None).strip()
    loss.backward()
    assert w.grad is not None


def test_torch_call_shape_gets_an_error_showing_the_right_call():
    def block(t):
        return t.sin()

    with pytest.raises(TypeError) as info:
        remat.checkpoint(block, torch.randn(2, requires_grad=True))
    assert isinstance(info.value, remat.RematUsageError)
    assert "remat_dist.checkpoint(region_name='layers.0')(block)(x)" in str(info.value)
    with pytest.raises(remat.RematUsageError, match=r"\(block\)\(\*args\)"):
        remat.checkpoint(nn.Linear(2, 2))
