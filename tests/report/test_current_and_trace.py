"""The current-memory report (inside a checkpoint forward) and the region trace."""

from __future__ import annotations

import io

import pytest
import torch

import remat_dist as remat
from remat_dist.report import (
    collect_trace,
    format_current_memory_report,
    print_current_memory_report,
    trace_scope,
)


class Softmax(torch.autograd.Function):
    """Saves two named tensors and a view of one of them."""

    @staticmethod
    def forward(ctx, x):
        lse = x.logsumexp(-1, keepdim=True)
        probs = (x - lse).exp()
        remat.save_for_backward(ctx, {"lse": lse, "probs": probs, "head": probs[:1]})
        return probs

    @staticmethod
    def backward(ctx, g):
        _, probs, _ = ctx.saved_tensors
        return probs * (g - (g * probs).sum(-1, keepdim=True))


def test_current_memory_report_format_names_views_once_per_storage():
    reports: list[str] = []

    def body(x):
        y = remat.region(Softmax.apply, "attn.softmax", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        if not remat.is_recomputing():
            reports.append(format_current_memory_report())
        return y.sin()

    x = torch.randn(3, 4, requires_grad=True)
    remat.checkpoint(region_name="layers.0")(body)(x).sum().backward()
    assert reports == [
        "\n".join(
            [
                "layers.0: 60 B resident in 2 storage(s)",
                "layers.0::attn.softmax: 60 B",
                "  12 B  lse                            (3, 1)  float32",
                "  48 B  probs, head (output at idx 0)  (3, 4)  float32",
                "layers.0 inputs: 48 B in 1 storage (kept so that replay can start)",
                "  48 B  x  (3, 4)  float32",
            ]
        )
    ]


def test_current_memory_report_counts_each_save_region_and_kept_outputs():
    w = torch.nn.Parameter(torch.randn(4, 4))
    reports: list[str] = []

    def body(x):
        a = remat.region(lambda t: (t * 2).exp(), "a", recompute=False)(x)
        remat.recompute_needs_tensor(a)  # free: exp saves its output anyway
        b = remat.region(lambda t: (t @ w).sin(), "b", recompute=False)(a.cos())
        remat.recompute_needs_tensor(b)  # not free: sin saves its input
        if not remat.is_recomputing():
            reports.append(format_current_memory_report(inputs=False))
        return b.tanh()

    x = torch.randn(3, 4, requires_grad=True)
    remat.checkpoint(region_name="c")(body)(x).sum().backward()
    (text,) = reports
    lines = text.splitlines()
    assert lines[0] == "c: 144 B resident in 3 storage(s)", text
    assert lines[1] == "c::a: 48 B", text
    assert lines[2].split() == ["48", "B", "saved.0", "(output", "at", "idx", "0)"] + [
        "(3,",
        "4)",
        "float32",
    ], text
    # sin input and b kept; w is a parameter; b's input a.cos() is recomputed by
    # replay, so torch's checkpoint recomputes it: not kept
    assert lines[3] == "c::b: 96 B", text
    assert "(parameter, not counted)" in text, text  # w, saved by the matmul
    assert "output 0 (kept for replay)" in lines[-1], text
    assert "inputs" not in text, text


def test_current_memory_report_leaves_out_parameters_and_their_views():
    """``linear`` saves ``weight.t()``, a view of a parameter: the current report
    lists it as a parameter and counts 0 B for it, as the saved-tensors report does
    (it used to count the whole weight as resident activation memory)."""
    lin = torch.nn.Linear(64, 64)
    seen = []

    def block(x):
        h = remat.region(lin, "lin", recompute=False)(x.sin())
        if not remat.is_recomputing():
            seen.append(remat.format_current_memory_report(inputs=False))
        remat.recompute_needs_tensor(h)
        return h.tanh()

    x = torch.randn(4, 64, requires_grad=True)
    y = remat.checkpoint(region_name="layers.0")(block)(x)
    text = seen[0]
    assert text.splitlines()[0] == "layers.0: 0 B resident in 0 storage(s)", text
    assert "(64, 64)  float32  (parameter, not counted)" in text, text
    summary = remat.report.saved_tensors_summary(y.sum())
    assert summary["parameter_bytes"] == 64 * 64 * 4


def test_current_memory_report_outside_and_during_replay():
    assert format_current_memory_report().startswith("no checkpoint is running")
    replay: list[str] = []

    def body(x):
        y = remat.region(torch.exp, "e", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        if remat.is_recomputing():
            replay.append(format_current_memory_report())
        return y.sin()

    x = torch.randn(4, requires_grad=True)
    remat.checkpoint(region_name="c")(body)(x).sum().backward()
    (text,) = replay
    assert text.splitlines()[0] == "(replay of c: showing what its forward kept)"
    assert text.splitlines()[1] == "c: 16 B resident in 1 storage(s)"


def test_print_current_memory_report_writes_the_format():
    out = io.StringIO()

    def body(x):
        remat.region(torch.exp, "e", recompute=False)(x)
        if not remat.is_recomputing():
            print_current_memory_report(file=out)
        return x.sin()

    remat.checkpoint(region_name="c")(body)(torch.randn(2, requires_grad=True))
    assert out.getvalue().startswith("c: 8 B resident in 1 storage(s)\nc::e: 8 B\n")


def _model_with_scopes():
    w = torch.nn.Parameter(torch.randn(4, 4))

    def inner(t):
        return (t @ w).tanh()

    def body(x):
        a = remat.region(
            lambda t: remat.region(torch.sin, "sin", recompute=False)(t) * 2,
            "attn",
            recompute=False,
        )(x)
        remat.recompute_needs_tensor(a)
        with remat.name_scope("expert0"):
            b = remat.region(inner, "ffn", recompute=True)(a)
        return trace_scope(torch.cos, "tail")(b)

    def model(x):
        for i in range(2):
            x = remat.checkpoint(region_name=f"layers.{i}")(body)(x)
        return x

    return trace_scope(model, "scope", metadata=["test_flag"])


EXPECTED_TRACE = "\n".join(
    [
        "remat_dist trace",
        "scope [test_flag]",
        "  layers.0: checkpoint",
        "    attn: save",
        "      sin: save",
        "    expert0/ffn: recompute",
        "    tail",
        "  layers.1: checkpoint",
        "    attn: save",
        "      sin: save",
        "    expert0/ffn: recompute",
        "    tail",
    ]
)


def test_trace_format_and_replay_not_double_counted():
    model = _model_with_scopes()
    x = torch.randn(3, 4, requires_grad=True)
    with collect_trace() as trace:
        y = model(x)
        before = trace.format()
        y.sum().backward()  # two replays inside the block
    assert before == EXPECTED_TRACE
    assert trace.format() == EXPECTED_TRACE
    assert ("scope/layers.0/attn/sin", "save") in trace.decisions()
    assert str(trace) == EXPECTED_TRACE
    assert trace.to_dict()["roots"][0]["metadata"] == ["test_flag"]


def test_trace_records_only_inside_the_block_and_nests():
    model = _model_with_scopes()
    x = torch.randn(3, 4, requires_grad=True)
    model(x)  # no trace active: nothing recorded anywhere
    with collect_trace() as outer:
        with collect_trace() as inner:
            trace_scope(lambda t: t + 1, "step", metadata={"micro": 0})(x)
        model(x).sum().backward()
    assert inner.format() == "remat_dist trace\nstep [micro=0]"
    assert outer.format().splitlines()[:3] == [
        "remat_dist trace",
        "step [micro=0]",
        "scope [test_flag]",
    ]
    model(x)  # after the block: the observer is gone
    assert len(outer.roots) == 2


def test_trace_survives_an_error_inside_a_region():
    def bad(t):
        raise ValueError("boom")

    def body(x):
        return remat.region(bad, "bad", recompute=False)(x)

    x = torch.randn(2, requires_grad=True)
    with collect_trace() as trace:
        with pytest.raises(ValueError):
            remat.checkpoint(region_name="c")(body)(x)
        trace_scope(torch.sin, "after")(x)
    assert trace.format().splitlines() == [
        "remat_dist trace",
        "c: checkpoint",
        "  bad: save",
        "after",
    ]


def test_trace_scope_validates_arguments():
    with pytest.raises(TypeError):
        trace_scope(3, "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        trace_scope(torch.sin, "")


def test_trace_shows_regions_outside_checkpoints():
    # torch_remat's format: plain-call regions appear with their decision
    x = torch.randn(3, 4)

    def step(t):
        t = remat.region(torch.sin, "sin", recompute=False)(t)
        return remat.region(torch.cos, "cos", recompute=True)(t)

    with collect_trace() as trace:
        y = trace_scope(step, "scope", metadata=["test_flag"])(x)
    assert torch.equal(y, torch.cos(torch.sin(x)))
    assert trace.format() == "remat_dist trace\nscope [test_flag]\n  sin: save\n  cos: recompute"


def test_a_name_given_by_save_for_backward_does_not_pass_to_a_later_tensor():
    """A named save packed outside any checkpoint leaves its names pending; once
    that tensor is gone, another tensor can get its storage's address. It must be
    reported under its own label, not the dead tensor's name."""

    class Exp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            probs = x.exp()
            remat.save_for_backward(ctx, {"probs": probs})
            return probs

        @staticmethod
        def backward(ctx, g):
            (probs,) = ctx.saved_tensors
            return g * probs

    x = torch.randn(3, 4, requires_grad=True)
    out = Exp.apply(x)  # no checkpoint: no remat hook reads the names
    address = out.untyped_storage()._cdata
    del out
    held = []
    for _ in range(1000):  # the allocator hands the freed address back
        y = torch.ones(3, 4)
        if y.untyped_storage()._cdata == address:
            break
        held.append(y)
    else:
        pytest.fail("no tensor got the freed storage's address back")
    reports: list[str] = []

    def body(t):
        h = remat.region(lambda t: y * t, "r", recompute=False)(t)  # saves y
        if not remat.is_recomputing():
            reports.append(format_current_memory_report(inputs=False))
        return h

    remat.checkpoint(region_name="c")(body)(x).sum().backward()
    assert torch.equal(x.grad, y)
    (text,) = reports
    assert text.splitlines()[2].split()[:3] == ["48", "B", "saved.0"], text
    assert "probs" not in text, text
