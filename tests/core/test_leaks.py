"""A graph dropped without backward frees what a save region kept, by reference
counting alone (no ``gc``), also under user ``saved_tensors_hooks``."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch._dynamo  # noqa: F401

import remat_dist as remat

# torch.utils.checkpoint imports torch._dynamo on its first call; that import leaves
# cycles holding the calling frame (and so that step's inputs) until a collection.
# Importing it up front keeps the one-time import out of what is measured.


def _identity_hooks(refs):
    def pack(t):
        refs.append(weakref.ref(t))
        return t

    return remat.saved_tensors_hooks(pack, lambda t: t)


def _offload_hooks(refs):
    def pack(t):
        refs.append(weakref.ref(t))
        on_cpu = t.to("cpu", copy=True)
        refs.append(weakref.ref(on_cpu))
        return t.device, on_cpu

    def unpack(packed):
        device, on_cpu = packed
        return on_cpu.to(device)

    return remat.saved_tensors_hooks(pack, unpack)


def _checkpointed_block():
    """A checkpointed block with a save region; exp saves its own output (the case
    that used to outlive the graph)."""
    w = torch.randn(8, 8, requires_grad=True)

    def block(x):
        y = remat.region(torch.exp, "exp", recompute=False)(x @ w)
        remat.recompute_needs_tensor(y)
        return y.sin() @ w

    return remat.checkpoint(region_name="layers.0")(block)


@pytest.mark.parametrize("make_hooks", [_identity_hooks, _offload_hooks])
def test_forward_only_steps_free_save_region_saves_without_gc(make_hooks):
    run = _checkpointed_block()
    refs: list[weakref.ref] = []
    hooks = make_hooks(refs)
    gc.disable()  # a cycle must not be hidden by an automatic collection
    try:
        _steps(run, hooks, refs)
    finally:
        gc.enable()


def _steps(run, hooks, refs):
    for step in range(50):
        seen = len(refs)
        x = torch.randn(4, 8)
        with hooks:
            out = run(x)
        assert out.grad_fn is not None and len(refs) > seen
        del out, x  # the graph is dropped without backward
        alive = [i for i, r in enumerate(refs) if r() is not None]
        assert not alive, f"step {step}: saved tensors {alive} outlive their graph"


@pytest.mark.parametrize("hooks", ["remat", "torch"])
def test_backward_frees_checkpoint_inputs_while_the_loss_is_kept(hooks):
    """Under user saved-tensor hooks, what the checkpoint keeps (its inputs, a save
    region's saves) is freed by backward itself, as torch's checkpoint does, not
    when the caller drops the loss (a training loop keeps it until the next step:
    a step's activations would overlap the next one's)."""
    run = _checkpointed_block()
    refs: list[weakref.ref] = []
    gc.collect()
    before = {id(r) for r in remat.core.live_records()}  # other tests' graphs

    def pack(t):
        refs.append(weakref.ref(t))
        return t

    pair = (
        remat.saved_tensors_hooks(pack, lambda t: t)
        if hooks == "remat"
        else torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    )
    gc.disable()
    try:
        for step in range(5):
            x = torch.randn(4, 8, requires_grad=True) * 1.0  # a fresh activation
            refs.append(weakref.ref(x))
            with pair:
                loss = run(x).sum()
            del x
            loss.backward()
            alive = [i for i, r in enumerate(refs) if r() is not None]
            assert not alive, f"step {step}: tensors {alive} outlive the backward"
            mine = [r for r in remat.core.live_records() if id(r) not in before]
            assert remat.is_recomputing() is False and not mine
            # loss kept, as a loop does until its next step
    finally:
        gc.enable()


def test_a_checkpoint_that_raises_under_user_hooks_frees_its_inputs():
    """A body that raises under user hooks: nothing of the failed checkpoint stays
    alive (its replay anchor used to form a cycle through autograd's C++ that gc
    cannot collect, keeping the inputs and the record)."""

    def body(t):
        t.sin()
        raise ValueError("boom")

    run = remat.checkpoint(region_name="layers.0")(body)
    hooks = remat.saved_tensors_hooks(lambda t: t, lambda t: t)
    gc.collect()
    before = {id(r) for r in remat.core.live_records()}  # other tests' graphs
    x = torch.randn(64, 64, requires_grad=True)
    inp = x * 2
    ref = weakref.ref(inp)
    with hooks, pytest.raises(ValueError, match="boom"):
        run(inp)
    del inp
    gc.collect()
    assert ref() is None
    assert [r for r in remat.core.live_records() if id(r) not in before] == []
