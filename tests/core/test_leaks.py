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


@pytest.mark.parametrize("make_hooks", [_identity_hooks, _offload_hooks])
def test_forward_only_steps_free_save_region_saves_without_gc(make_hooks):
    w = torch.randn(8, 8, requires_grad=True)

    def block(x):
        # exp saves its own output: the case that used to outlive the graph
        y = remat.region(torch.exp, "exp", recompute=False)(x @ w)
        remat.recompute_needs_tensor(y)
        return y.sin() @ w

    run = remat.checkpoint(region_name="layers.0")(block)
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
