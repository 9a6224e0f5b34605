"""The saved-tensors report: totals equal an independent count, under every plan."""

from __future__ import annotations

import io

import pytest
import torch

import remat_dist as remat
from remat_dist.report import (
    build_saved_tensors_report,
    collect_trace,
    format_current_memory_report,
    format_saved_tensors_report,
    print_saved_tensors_report,
    saved_tensors_summary,
)
from remat_dist.testing import SavedBytesCounter
from tests.report.plans import PLANS, model_and_batch


@pytest.mark.parametrize("plan", PLANS)
def test_totals_equal_independent_count(plan):
    model, tokens, targets = model_and_batch(plan)
    with SavedBytesCounter(model.parameters()) as counter:
        loss = model.loss(tokens, targets)
    report = build_saved_tensors_report(loss)
    assert report.total_bytes == counter.activation_bytes > 0
    assert report.parameter_bytes == counter.parameter_bytes
    assert report.total_bytes == (
        report.regions_bytes
        + report.checkpoint_input_bytes
        + report.outside_regions_bytes
    )
    if plan == "none":
        assert report.checkpoints == [] and report.checkpoint_input_bytes == 0
    else:
        assert [cp.name for cp in report.checkpoints] == [
            f"layers.{i}" for i in range(4)
        ]
        assert report.checkpoint_input_bytes > 0
    if plan == "full":
        assert report.regions_bytes == 0
    if plan.startswith("attention_saved"):
        assert report.regions_bytes > 0
        # everything went through the user hook, and the report says so
        assert report.user_hook_bytes > 0
    loss.backward()  # the graph is intact after the report


@pytest.mark.parametrize("plan", PLANS)
def test_totals_without_hooks_match_the_hooked_run(plan):
    model, tokens, targets = model_and_batch(plan)
    with SavedBytesCounter(model.parameters()) as counter:
        hooked = build_saved_tensors_report(model.loss(tokens, targets))
    plain = build_saved_tensors_report(model.loss(tokens, targets))
    assert plain.total_bytes == hooked.total_bytes == counter.activation_bytes
    assert plain.summary()["regions"] == hooked.summary()["regions"]
    assert plain.parameter_bytes == hooked.parameter_bytes
    assert plain.user_hook_bytes == 0


def test_plans_order_and_report_text():
    sizes = {}
    for plan in PLANS:
        model, tokens, targets = model_and_batch(plan)
        sizes[plan] = build_saved_tensors_report(
            model.loss(tokens, targets)
        ).total_bytes
    assert sizes["full"] < sizes["attention_saved"] < sizes["none"]
    # the two ways of persisting the attention output keep the same bytes
    assert sizes["attention_saved"] == sizes["attention_saved_residual_region"]

    model, tokens, targets = model_and_batch("attention_saved")
    loss = model.loss(tokens, targets)
    text = format_saved_tensors_report(loss)
    lines = text.splitlines()
    assert lines[0].startswith("saved for backward: ")
    assert "-- 4 region(s)" in lines[0] and "checkpoint inputs" in lines[0]
    assert lines[1].startswith("parameters saved (not counted above): ")
    # identical checkpoints are grouped, in the summary and in the detail
    regions_line = lines[lines.index("regions:") + 1]
    assert "x4  layers.0-3" in regions_line and "storages each" in regions_line
    assert "[x4: layers.0-3]" in lines
    assert "layers.0::attention: " in text
    assert "output 0 (kept for replay)" in text
    assert any(line.startswith("outside regions: ") for line in lines)
    assert "NllLossBackward0 (x1)" in text
    buf = io.StringIO()
    print_saved_tensors_report(loss, file=buf)
    assert buf.getvalue() == text + "\n"


def test_unequal_checkpoints_are_not_grouped():
    model, tokens, targets = model_and_batch("attention_saved")
    plain = model.block_runner

    def mixed(block, x, name):  # layer 2 runs without a save region
        if name == "layers.2":
            return remat.checkpoint(region_name=name)(block)(x)
        return plain(block, x, name)

    model.block_runner = mixed
    text = format_saved_tensors_report(model.loss(tokens, targets))
    assert "x3  layers.0-1,3" in text
    assert "x1  layers.2" in text


def test_shared_storage_is_counted_once():
    w = torch.nn.Parameter(torch.randn(4, 4))

    def body(x):
        a = remat.region(lambda t: (t @ w).sin(), "a", recompute=False)(x)
        remat.recompute_needs_tensor(a)
        return a.exp()

    x = torch.randn(3, 4, requires_grad=True)
    h = x.tanh()  # saves its result h, which is also the checkpoint's input
    y = remat.checkpoint(region_name="c")(body)(h)
    loss = (y * h).sum()  # h saved once more, by MulBackward0
    report = build_saved_tensors_report(loss)
    # h is the checkpoint's input (counted there), and also mm's input inside region
    # a (recomputed by replay, so a does not keep it) and saved by TanhBackward0 and
    # MulBackward0 outside. Region a keeps sin's input and its output a for replay;
    # w is a parameter; outside, MulBackward0 adds y. Each storage once: 4 x 48 B.
    assert report.checkpoint_input_bytes == 48
    assert report.regions_bytes == 2 * 48
    assert report.outside_regions_bytes == 48
    assert report.total_bytes == 4 * 48
    assert report.parameter_bytes == 64  # w
    s = report.summary()
    assert s["regions"] == [
        {"name": "c", "bytes": 96, "storages": 2, "input_bytes": 48}
    ]
    loss.backward()


def test_views_and_names_fold_into_storages():
    class Softmax(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            lse = x.logsumexp(-1, keepdim=True)
            probs = (x - lse).exp()
            remat.save_for_backward(
                ctx, {"lse": lse, "probs": probs, "probs_head": probs[:1]}
            )
            return probs

        @staticmethod
        def backward(ctx, g):
            _, probs, _ = ctx.saved_tensors
            return probs * (g - (g * probs).sum(-1, keepdim=True))

    def body(x):
        y = remat.region(Softmax.apply, "softmax", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        return y.cos()

    x = torch.randn(3, 4, requires_grad=True)
    loss = remat.checkpoint(region_name="blk")(body)(x).sum()
    report = build_saved_tensors_report(loss)
    (cp,) = report.checkpoints
    (region,) = cp.regions
    labels = [r.label for r in region.rows]
    assert labels == ["lse", "probs, probs_head (output at idx 0)"]
    assert [r.nbytes for r in region.rows] == [12, 48]
    assert cp.nbytes == 60 and cp.storages == 2
    assert cp.input_bytes == 48  # x
    assert report.total_bytes == 60 + 48


def test_no_roots_discovers_live_graphs():
    # no roots: discovered with gc; a detached tensor has no graph at all
    assert build_saved_tensors_report(torch.zeros(3)).total_bytes == 0
    x = torch.randn(5, requires_grad=True)
    y = x.exp()  # keep y alive: it is the only root
    found = saved_tensors_summary()
    assert found["outside_regions_bytes"] >= 20
    del y


def test_reports_never_change_the_run():
    def grads(with_reports: bool):
        probe = None
        seen = []
        if with_reports:

            def probe():
                if not remat.is_recomputing():
                    seen.append(format_current_memory_report())

        model, tokens, targets = model_and_batch("attention_saved", probe=probe)
        if with_reports:
            with collect_trace() as trace:
                loss = model.loss(tokens, targets)
                format_saved_tensors_report(loss)
                saved_tensors_summary(loss)
                loss.backward()
            assert len(trace.roots) == 4
            assert len(seen) == 4
        else:
            loss = model.loss(tokens, targets)
            loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    plain, reported = grads(False), grads(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, reported, strict=True))


def test_report_keeps_nothing_alive():
    import gc

    from remat_dist.core import live_records

    gc.collect()
    before = set(live_records())  # other tests' graphs, if any are still alive
    model, tokens, targets = model_and_batch("attention_saved")
    loss = model.loss(tokens, targets)
    report = build_saved_tensors_report(loss)
    assert len(set(live_records()) - before) == 4
    loss.backward()
    del loss
    gc.collect()
    assert set(live_records()) - before == set()  # the kept report holds none
    assert report.format().startswith("saved for backward: ")


def test_scope_state_is_counted_and_its_tensors_are_not():
    # weight noise in gradient_checkpoint_scope: the noisy weights are recomputed
    # (autograd keeps recompute handles), the scopes keep their RNG snapshots
    from remat_dist.core import live_scope_records

    torch.manual_seed(0)
    x = torch.randn(16, 64)
    ws = [torch.randn(64, 64, requires_grad=True) for _ in range(3)]
    with SavedBytesCounter(ws) as counter:
        h = x
        for w in ws:
            with remat.gradient_checkpoint_scope():
                noisy = w + torch.randn_like(w) * 0.01
            h = torch.tanh(h @ noisy)
        loss = h.sum()
    state = sum(r.stats()["state_bytes"] for r in live_scope_records())
    report = build_saved_tensors_report(loss)
    assert state >= 5056  # CPU RNG snapshots (5056 B each)
    assert report.total_bytes == counter.activation_bytes + state
    assert "gradient_checkpoint_scope state" in report.format()
    loss.backward()
