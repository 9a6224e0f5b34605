"""OOM observer, root discovery and allocation-site annotations.

The CUDA parts run only with a GPU (``@pytest.mark.gpu``); the rest is checked on
CPU by calling the observer the way the allocator would, and by annotating from a
hand-made snapshot.
"""

from __future__ import annotations

import io
import os
import tempfile
import warnings
from types import SimpleNamespace

import pytest
import torch

import remat_dist as remat
from remat_dist.report import (
    attach_oom_observer,
    build_saved_tensors_report,
    discover_autograd_roots,
    format_oom_saved_tensors_report,
    format_saved_tensors_report,
    gather_saved_tensors_report,
    memory_snapshot_annotate,
    oom_observer,
)
from remat_dist.report._annotate import allocation_site
from tests.report.plans import model_and_batch


def test_discover_autograd_roots_finds_graph_heads_only():
    x = torch.randn(4, requires_grad=True)
    mid = x.exp()
    loss_a = mid.sin().sum()
    loss_b = (x * 3).cos().sum()
    roots = discover_autograd_roots()
    # the nodes themselves, held: on torch 2.11 and 2.12 a node's Python object
    # lives only while referenced, so the id of a dropped one means nothing
    fns = [t.grad_fn for t in roots]
    assert any(f is loss_a.grad_fn for f in fns) and any(f is loss_b.grad_fn for f in fns)
    assert not any(f is mid.grad_fn for f in fns)  # an input of loss_a's graph
    # the report over the discovered roots covers both graphs
    assert (
        build_saved_tensors_report(*roots).total_bytes
        >= build_saved_tensors_report(loss_a, loss_b).total_bytes
    )


def test_oom_observer_prints_the_report_as_the_allocator_would_call_it():
    model, tokens, targets = model_and_batch("attention_saved")
    loss = model.loss(tokens, targets)
    out = io.StringIO()
    observe = oom_observer(lambda: [loss], file=out)
    observe(0, 3 * 2**30, 5 * 2**30, 2**20)
    text = out.getvalue()
    first, rest = text.split("\n", 1)
    assert first == (
        "remat_dist: CUDA out of memory on device 0: tried to allocate 3.0 GiB "
        "with 5.0 GiB allocated and 1.0 MiB free"
    )
    assert rest.startswith(format_saved_tensors_report(loss))


def test_oom_observer_attached_itself_as_torch_remats_is(capsys):
    # torch_remat code attaches the function itself; the allocator then calls it
    # with its four numbers, and it reports the live graphs (found by gc) on stderr
    model, tokens, targets = model_and_batch("attention_saved")
    loss = model.loss(tokens, targets)
    assert oom_observer(0, 3 * 2**30, 5 * 2**30, 2**20) is None
    err = capsys.readouterr().err
    assert err.startswith("remat_dist: CUDA out of memory on device 0: tried to")
    # the live graphs (loss's among them, maybe others of this process)
    assert "\nsaved for backward: " in err and "layers.0" in err
    # and torch_remat's format call, annotate only
    text = format_oom_saved_tensors_report(annotate=None, roots=[loss])
    assert text.startswith("remat_dist: saved tensors at CUDA out of memory\n")
    assert format_saved_tensors_report(loss) in text
    with pytest.raises(TypeError, match="allocator's observer"):
        oom_observer(0, 1)


def test_oom_observer_reports_the_running_checkpoint_and_never_raises():
    out = io.StringIO()
    observe = oom_observer([], file=out)

    def body(x):
        remat.region(torch.exp, "e", recompute=False)(x)
        if not remat.is_recomputing():
            observe(1, 10, 20, 30)  # as if an allocation failed right here
        return x.sin()

    remat.checkpoint(region_name="layers.7")(body)(torch.randn(2, requires_grad=True))
    text = out.getvalue()
    assert "no live autograd graph found" in text
    assert "checkpoint running when the allocation failed:\nlayers.7: 8 B" in text

    def broken():
        raise RuntimeError("roots unavailable")

    out = io.StringIO()
    oom_observer(broken, file=out)(0, 1, 2, 3)
    assert "the OOM saved-tensors report failed" in out.getvalue()
    assert "roots unavailable" in out.getvalue()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_cuda_only_parts_without_cuda():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert attach_oom_observer() is None
    assert "CUDA is not available" in str(caught[0].message)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        memory_snapshot_annotate()


def _fake_cuda_tensor(ptr: int, index: int = 0):
    storage = SimpleNamespace(data_ptr=lambda: ptr)
    return SimpleNamespace(
        device=torch.device("cuda", index), untyped_storage=lambda: storage
    )


def test_memory_snapshot_annotate_from_a_snapshot():
    user = {"filename": "/home/me/model.py", "line": 42, "name": "forward"}
    torch_frame = {"filename": "/x/site-packages/torch/nn/functional.py", "line": 9}
    snapshot = {
        "segments": [
            {
                "device": 0,
                "address": 1000,
                "blocks": [
                    {
                        "size": 100,
                        "state": "active_allocated",
                        "frames": [torch_frame, user],
                    },
                    {"size": 50, "state": "inactive", "frames": [user]},
                    {"size": 200, "state": "active_allocated", "frames": [torch_frame]},
                    {"size": 10, "state": "active_allocated", "frames": []},
                ],
            },
            {
                "device": 1,
                "address": 1000,
                "blocks": [
                    {
                        "address": 1000,
                        "size": 100,
                        "state": "active_allocated",
                        "frames": [{"filename": "b.py", "line": 1, "name": "g"}],
                    }
                ],
            },
        ]
    }
    annotate = memory_snapshot_annotate(snapshot)
    assert annotate(_fake_cuda_tensor(1000)) == "model.py:42 forward"
    assert annotate(_fake_cuda_tensor(1099)) == "model.py:42 forward"
    assert annotate(_fake_cuda_tensor(1120)) is None  # a free block
    assert annotate(_fake_cuda_tensor(1150)) == "functional.py:9"  # only torch frames
    assert annotate(_fake_cuda_tensor(1355)) is None  # recorded without frames
    assert annotate(_fake_cuda_tensor(1000, index=1)) == "b.py:1 g"
    assert annotate(_fake_cuda_tensor(1000, index=2)) is None
    assert annotate(torch.zeros(2)) is None  # CPU tensors are never placed
    assert allocation_site(None) is None


def test_annotate_labels_report_rows_and_failures_are_ignored():
    x = torch.randn(3, requires_grad=True)
    loss = x.exp().sum()
    text = format_saved_tensors_report(loss, annotate=lambda t: "here.py:1")
    # outside saves: per node type, and with annotations their storages too
    assert (
        "  12 B  ExpBackward0 (x1)\n          12 B  (3,)  float32  @ here.py:1" in text
    )

    def body(t):
        y = remat.region(torch.exp, "e", recompute=False)(t)
        remat.recompute_needs_tensor(y)
        return y.sin()

    loss = remat.checkpoint(region_name="c")(body)(x).sum()
    text = format_saved_tensors_report(loss, annotate=lambda t: f"site{t.numel()}")
    assert "ExpBackward0.result (output at idx 0)  (3,)  float32  @ site3" in text

    def broken(t):
        raise ValueError("no")

    assert "@" not in format_saved_tensors_report(loss, annotate=broken)


# -- CUDA ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_oom_observer_prints_on_a_real_out_of_memory():
    model, tokens, targets = model_and_batch("attention_saved")
    model.cuda()
    loss = model.loss(tokens.cuda(), targets.cuda())
    out = io.StringIO()
    assert attach_oom_observer(lambda: [loss], file=out) is not None
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2**50, dtype=torch.uint8, device="cuda")
    text = out.getvalue()
    assert "remat_dist: CUDA out of memory on device" in text
    assert "saved for backward: " in text and "x4  layers.0-3" in text
    loss.backward()


@pytest.mark.gpu
def test_gpu_memory_snapshot_annotate_labels_allocation_sites():
    torch.cuda.memory._record_memory_history(max_entries=10000)
    try:

        def body(t):
            y = remat.region(torch.exp, "e", recompute=False)(t)
            remat.recompute_needs_tensor(y)
            return y.sin()

        x = torch.randn(1024, device="cuda", requires_grad=True)
        loss = remat.checkpoint(region_name="c")(body)(x).sum()
        text = format_saved_tensors_report(loss, annotate=memory_snapshot_annotate())
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    row = next(line for line in text.splitlines() if "(output at idx 0)" in line)
    assert "@ test_oom_and_annotate.py:" in row, text


@pytest.mark.gpu
def test_gpu_gather_on_nccl_single_rank():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        try:
            model, tokens, targets = model_and_batch("full")
            model.cuda()
            loss = model.loss(tokens.cuda(), targets.cuda())
            report = gather_saved_tensors_report(loss)
            assert report is not None and report.world_size == 1
            assert (
                report.ranks[0].total_bytes
                == build_saved_tensors_report(loss).total_bytes
            )
        finally:
            dist.destroy_process_group()
