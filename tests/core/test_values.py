"""``determinism_check="values"`` in one process: a replay that saves a tensor of
the same shape and dtype but other values raises ``ReplayValueMismatchError`` at
the end of backward, naming the checkpoint, the tensor and the op; deterministic
replays (dropout included) never raise and give the gradients of the run without
checkpointing, bit for bit."""

from __future__ import annotations

import pytest
import torch

import remat_dist as remat
from remat_dist.core import fingerprint


def _block(w: torch.Tensor, skew: dict[str, float]):
    def body(x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(x @ w, p=0.25)
        if remat.is_recomputing():
            h = h * skew.get("by", 1.0)  # what a nondeterministic op would do
        h = remat.region(torch.tanh, "act", recompute=True)(h)
        return h.cos()

    return body


def _grads(check: str | None, skew: dict[str, float] | None = None):
    torch.manual_seed(0)
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(5, 6, requires_grad=True)
    body = _block(w, skew or {})
    torch.manual_seed(1)
    out = (
        body(x)
        if check is None
        else remat.checkpoint(region_name="blk", determinism_check=check)(body)(x)
    )
    out.sum().backward()
    return x.grad, w.grad


def test_dropout_replay_no_false_alarm_and_exact():
    ref = _grads(None)
    for _ in range(20):
        got = _grads("values")
        assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_other_values_raise_at_backward_end():
    with pytest.raises(remat.errors.ReplayValueMismatchError) as ei:
        _grads("values", {"by": 1.0 + 2**-20})
    text = str(ei.value)
    assert "checkpoint 'blk'" in text and "other values than the forward" in text
    assert "#3 in region 'blk::act'" in text and "TanhBackward0" in text, text
    assert "GeneratorStateHook" in text  # the fixes
    # also a ReplayMismatchError (a replay that did not reproduce its forward)
    assert isinstance(ei.value, remat.errors.ReplayMismatchError)
    assert isinstance(ei.value, remat.errors.CollectiveReplayError)


def test_silent_without_the_check():
    _grads("metadata", {"by": 1.5})
    _grads("metadata_per_tensor", {"by": 1.5})


def test_environment_turns_it_on(monkeypatch):
    monkeypatch.setenv("REMAT_DIST_DETERMINISM_CHECK", "values")
    with pytest.raises(remat.errors.ReplayValueMismatchError):
        _grads("metadata", {"by": 1.5})
    monkeypatch.setenv("REMAT_DIST_DETERMINISM_CHECK", "metadata")
    _grads("metadata", {"by": 1.5})


def test_the_error_waits_for_the_end_of_backward():
    # a tensor outside the checkpoint gets its gradient before the error is raised
    torch.manual_seed(0)
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(5, 6, requires_grad=True)
    y = remat.checkpoint(region_name="blk", determinism_check="values")(
        _block(w, {"by": 2.0})
    )(x)
    with pytest.raises(remat.errors.ReplayValueMismatchError):
        (y.sum() + (x * 3).sum()).backward()
    assert x.grad is not None


def test_retain_graph_replays_are_each_checked():
    torch.manual_seed(0)
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(5, 6, requires_grad=True)
    skew: dict[str, float] = {}
    y = remat.checkpoint(region_name="blk", determinism_check="values")(
        _block(w, skew)
    )(x)
    y.sum().backward(retain_graph=True)
    skew["by"] = 3.0
    with pytest.raises(remat.errors.ReplayValueMismatchError):
        y.sum().backward()


def test_unknown_check_names_values():
    with pytest.raises(remat.RematUsageError, match="values"):
        remat.checkpoint(region_name="blk", determinism_check="bits")


def test_fingerprint_sees_bytes_and_positions():
    t = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    same = fingerprint(t.clone())
    assert torch.equal(fingerprint(t), same)
    assert not torch.equal(fingerprint(t[[1, 0, 2, 3, 4, 5]]), same)  # rows swapped
    u = t.clone()
    u[3, 2] = torch.nextafter(u[3, 2], torch.tensor(100.0))  # one ulp
    assert not torch.equal(fingerprint(u), same)
    assert not torch.equal(
        fingerprint(torch.tensor([3, 1, 2])), fingerprint(torch.tensor([1, 3, 2]))
    )
    assert fingerprint(torch.empty(0)) is None
    assert fingerprint(torch.empty(3, device="meta")) is None
    # non-contiguous, odd sizes and bool work too
    assert fingerprint(t.t()) is not None
    assert fingerprint(torch.ones(3, 3, dtype=torch.bool)) is not None
    assert fingerprint(torch.ones(5, dtype=torch.bfloat16)[1:]) is not None
