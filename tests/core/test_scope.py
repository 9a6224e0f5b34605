"""gradient_checkpoint_scope: what autograd keeps, replay exactness, RETURNN's defects."""

from __future__ import annotations

import contextlib
import copy
import gc
import pickle
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch.multiprocessing.reductions import StorageWeakRef

import remat_dist as remat
from remat_dist import RematError, RematUsageError
from remat_dist.core._scope import (
    ScopeOutput,
    active_scope_depth,
    gradient_checkpoint_scope,
    live_scope_records,
)
from remat_dist.testing import SavedBytesCounter

_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def _no_hook_installed() -> bool:
    return _top_hooks(True) is None


def _no_dispatch_mode() -> bool:
    return torch._C._len_torch_dispatch_stack() == 0


class _Kept:
    """An outer saved-tensor hook that records what autograd keeps (by storage)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        self.storages[st.data_ptr()] = st.nbytes()
        return t.detach()

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def holds(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.storages

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> _Kept:
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


def _scope(use: bool):
    return gradient_checkpoint_scope() if use else contextlib.nullcontext()


def _grads_equal(fn, params, seed: int = 0) -> None:
    """fn(use_scope) -> loss; gradients and the RNG state after the step must be
    bitwise equal with and without the scope, and nothing may stay installed."""
    results = []
    for use in (False, True):
        torch.manual_seed(seed)
        for p in params:
            p.grad = None
        fn(use).sum().backward()
        results.append(([p.grad.clone() for p in params], torch.get_rng_state()))
        assert _no_hook_installed() and _no_dispatch_mode()
    (g0, rng0), (g1, rng1) = results
    for a, b in zip(g0, g1, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    assert torch.equal(rng0, rng1)


def _assert_keeps_less(fn, seed: int = 0) -> None:
    """fn(use_scope) -> loss: with the scope, autograd keeps fewer bytes for
    backward (counted by SavedBytesCounter, parameters apart) than without."""
    saved = {}
    for use in (False, True):
        torch.manual_seed(seed)
        with SavedBytesCounter() as count:
            out = fn(use)
        out.sum().backward()
        saved[use] = count.activation_bytes
    assert saved[True] < saved[False], saved


class Block(nn.Module):
    """LayerNorm -> causal attention -> residual -> LayerNorm -> MLP -> residual."""

    def __init__(self, d: int = 32, heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.h = heads
        self.p = dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        y = self.ln1(x)
        q, k, v = (
            m(y).view(B, S, self.h, D // self.h).transpose(1, 2)
            for m in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, S, D))
        return x + self.fc2(F.dropout(F.gelu(self.fc1(self.ln2(x))), self.p))


def _model(
    seed: int = 0, layers: int = 3, dropout: float = 0.1
) -> tuple[nn.ModuleList, torch.Tensor]:
    torch.manual_seed(seed)
    blocks = nn.ModuleList(Block(dropout=dropout) for _ in range(layers))
    x = torch.randn(2, 16, 32, requires_grad=True)
    return blocks, x


# --- the seed example -------------------------------------------------------------


def test_seed_example_bitwise_and_nothing_activation_sized_kept():
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(512, 512, generator=g, requires_grad=True) for _ in range(3))
    act = 512 * 512 * 4
    runs = []
    for use in (False, True):
        torch.manual_seed(1)
        for t in (a, b, c):
            t.grad = None
        with _Kept() as kept:
            with _scope(use) as scope:
                x = a + b + torch.randn(512, 512)
            y = x * c
        assert kept.holds(c)
        assert kept.holds(x) is not use  # without the scope autograd keeps x
        x_storage = StorageWeakRef(x.untyped_storage())
        del x
        gc.collect()
        # With the scope, x's memory is gone before backward starts.
        assert x_storage.expired() is use
        if use:
            assert kept.bytes == act  # c only
            stats = scope.record.stats()
            assert stats["rng_state_bytes"] == torch.get_rng_state().numel() == 5056
            assert stats["input_bytes"] == 0 and stats["snapshot_bytes"] == 0
            assert stats["leaf_inputs"] == 2  # a and b, alive anyway
            assert scope.kept_bytes() == 5056
            assert stats["handles"] == 1
        y.sum().backward()
        runs.append(([t.grad.clone() for t in (a, b, c)], torch.get_rng_state()))
        assert _no_hook_installed()
    (g0, r0), (g1, r1) = runs
    assert all(torch.equal(p, q) for p, q in zip(g0, g1, strict=True))
    assert torch.equal(r0, r1)
    assert scope.record.stats()["open"] is False  # consumed by backward, released
    assert scope.kept_bytes() == 0


def test_scope_output_stays_a_tensor_and_turns_plain_after_backward():
    a = torch.randn(4, requires_grad=True)
    with gradient_checkpoint_scope() as scope:
        x = a * 2
    assert isinstance(x, torch.Tensor) and type(x) is ScopeOutput
    assert x.shape == (4,) and x.grad_fn is not None
    (x * a).sum().backward()
    assert type(x) is torch.Tensor and not scope.record.stats()["open"]
    assert torch.equal(a.grad, (4 * a).detach())
    with gradient_checkpoint_scope() as scope:
        z = a * 3
    z.exp().sum().backward()  # nothing saved z: the record stays until z dies
    assert type(z) is ScopeOutput and scope.record.stats()["open"]
    del z
    assert not scope.record.stats()["open"]


def test_weight_noise_used_by_several_ops_stored_by_none():
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    xs = [torch.randn(8, 64, requires_grad=True) for _ in range(3)]

    def loss(use: bool) -> torch.Tensor:
        with _Kept() as kept:
            with _scope(use) as scope:
                noisy = w + torch.randn_like(w) * 0.1
            out = sum((x @ noisy).tanh().sum() for x in xs) + (noisy * noisy).sum()
        assert kept.holds(noisy) is not use
        if use:
            assert scope.record.stats()["handles"] == 5  # 3 matmuls, 2 in n * n
            loss.scope = scope
        return out

    _grads_equal(loss, [w, *xs])
    # One replay served all four consumers in the backward pass.
    assert loss.scope.record.stats()["replays"] == 1
    assert loss.scope.record.stats()["open"] is False


def test_block_chain_and_residual_loop_bitwise():
    blocks, x0 = _model()
    params = [x0, *blocks.parameters()]

    def chain(use: bool) -> torch.Tensor:
        x = x0
        for blk in blocks:
            with _scope(use):
                x = blk(x)
        return x

    def residual(use: bool) -> torch.Tensor:
        x = x0
        for blk in blocks:
            with _scope(use):
                h = blk(x)
            x = x + h
        return x

    _grads_equal(chain, params)
    _grads_equal(residual, params)
    _assert_keeps_less(chain)
    _assert_keeps_less(residual)


def test_block_replays_once_and_keeps_no_activation():
    blocks, x0 = _model(layers=1)
    leaves = {t.untyped_storage().data_ptr() for t in (x0, *blocks.parameters())}
    with _Kept() as kept:
        with gradient_checkpoint_scope() as scope:
            y = blocks[0](x0)
        loss = y.sum()
    assert set(kept.storages) <= leaves  # the input and weights only
    stats = scope.record.stats()
    assert stats["input_bytes"] == 0 and stats["handles"] > 10
    # The dropout and SDPA (which takes a dropout_p) each get a snapshot.
    assert stats["rng_state_bytes"] == 2 * 5056
    loss.backward()
    assert scope.record.stats()["replays"] == 1


# --- RETURNN's defects --------------------------------------------------------------


def test_two_scopes_alive_at_once_both_protected():
    a = torch.randn(256, 256, requires_grad=True)

    def loss(use: bool) -> torch.Tensor:
        with _Kept() as kept:
            with _scope(use):
                x1 = a.exp()
            with _scope(use):
                x2 = a.sin()
            y = x1 * x2
        assert kept.holds(x1) is not use
        assert kept.holds(x2) is not use
        return y

    _grads_equal(loss, [a])


def test_nested_scopes_all_protected():
    a = torch.randn(256, 256, requires_grad=True)
    depths = []

    def loss(use: bool) -> torch.Tensor:
        with _Kept() as kept:
            with _scope(use) as outer:
                x1 = a.exp()
                depths.append(active_scope_depth())
                with _scope(use) as inner:
                    x2 = x1.sin()
                    depths.append(active_scope_depth())
                x3 = x2 * x1
                depths.append(active_scope_depth())
            y = x3 * x1 * x2
        depths.append(active_scope_depth())
        if use:
            assert inner.record is outer.record
        for t in (x1, x2, x3):
            assert kept.holds(t) is not use
        return y

    _grads_equal(loss, [a])
    assert depths[4:] == [1, 2, 1, 0]


def test_residual_loop_leaves_no_hook_and_torch_checkpoint_works_after():
    blocks, x0 = _model()
    x = x0
    scopes = []
    for blk in blocks:
        with gradient_checkpoint_scope() as s:
            h = blk(x)
        scopes.append(s)
        assert _no_hook_installed()
        x = x + h
    x.sum().backward()
    assert _no_hook_installed() and _no_dispatch_mode()
    assert type(h) is torch.Tensor  # released: no subclass left either
    assert not any(s.record.stats()["open"] for s in scopes)
    assert not any(s.record in live_scope_records() for s in scopes)

    # torch.utils.checkpoint and a plain backward in the same thread still work.
    x0.grad = None
    torch.manual_seed(0)
    ref = blocks[0](x0)
    ref.sum().backward()
    g_ref = x0.grad.clone()
    x0.grad = None
    torch.manual_seed(0)
    out = tuc.checkpoint(blocks[0], x0, use_reentrant=False)
    out.sum().backward()
    assert torch.equal(x0.grad, g_ref)


def test_retain_graph_backward_frees_recomputed_tensors():
    blocks, x0 = _model(layers=2)
    params = [x0, *blocks.parameters()]
    torch.manual_seed(3)
    y = blocks[1](blocks[0](x0))
    y.sum().backward()
    ref = [p.grad.clone() for p in params]

    for p in params:
        p.grad = None
    torch.manual_seed(3)
    scopes = []
    x = x0
    for blk in blocks:
        with gradient_checkpoint_scope() as s:
            x = blk(x)
        scopes.append(s)
    rng_after_forward = torch.get_rng_state()
    loss = x.sum()
    loss.backward(retain_graph=True)
    for s in scopes:
        stats = s.record.stats()
        assert stats["open"] and stats["cached_bytes"] == 0 and stats["replays"] == 1
    first = [p.grad.clone() for p in params]
    assert all(torch.equal(a, b) for a, b in zip(first, ref, strict=True))
    for p in params:
        p.grad = None
    loss.backward()
    assert all(torch.equal(p.grad, b) for p, b in zip(params, ref, strict=True))
    assert torch.equal(torch.get_rng_state(), rng_after_forward)
    assert all(s.record.stats()["cached_bytes"] == 0 for s in scopes)


def test_scopes_in_threads_do_not_interfere():
    # Random draws from a per-thread generator: the global one is shared.
    blocks, _ = _model(layers=2, dropout=0.0)
    inputs = [
        torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(i))
        for i in range(3)
    ]
    uses = [True, True, False]  # two threads with scopes, one without

    def grads(i: int, barrier: threading.Barrier | None) -> tuple[torch.Tensor, int]:
        x0 = inputs[i].clone().requires_grad_()
        x = x0
        gen = torch.Generator().manual_seed(5)
        with SavedBytesCounter(blocks.parameters()) as count:
            for blk in blocks:
                with _scope(uses[i]):
                    if barrier is not None:
                        barrier.wait()  # all three threads are inside their block
                        depths[i] = active_scope_depth()
                    x = blk(x) * torch.rand(x.shape, generator=gen)
                    if barrier is not None:
                        barrier.wait()
        (gx,) = torch.autograd.grad(x.sum(), x0)
        return gx, count.activation_bytes

    depths: dict[int, int] = {}
    refs = [grads(i, None) for i in range(3)]
    # Same shapes in every thread: the two scoped ones keep less for backward.
    assert refs[0][1] == refs[1][1] < refs[2][1]
    out: dict[int, tuple[torch.Tensor, int]] = {}
    barrier = threading.Barrier(3)
    threads = [
        threading.Thread(target=lambda i=i: out.__setitem__(i, grads(i, barrier)))
        for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert depths == {0: 1, 1: 1, 2: 0}
    for i in range(3):
        assert torch.equal(out[i][0], refs[i][0])
        assert out[i][1] == refs[i][1]  # each thread kept what it keeps alone
    assert _no_hook_installed()


# --- checkpoints ---------------------------------------------------------------------


def test_scope_inside_remat_checkpoint_is_a_no_op():
    # No dropout: the checkpoint restores only the device RNG by default.
    blocks, x0 = _model(layers=1, dropout=0.0)
    depth = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        with gradient_checkpoint_scope() as s:
            depth.append(active_scope_depth())
            y = blocks[0](x).cos()
        assert s.record is None
        return y

    def loss(use: bool) -> torch.Tensor:
        if use:
            return remat.checkpoint(region_name="blk")(fn)(x0)
        return blocks[0](x0).cos()

    _grads_equal(loss, [x0, *blocks.parameters()])
    assert depth and set(depth) == {0}


def test_remat_checkpoint_inside_scope_refused_at_entry():
    blocks, x0 = _model(layers=1)
    with pytest.raises(RematUsageError, match="inner"):
        with gradient_checkpoint_scope():
            remat.checkpoint(region_name="inner")(blocks[0])(x0)
    assert active_scope_depth() == 0 and _no_hook_installed() and _no_dispatch_mode()


def test_torch_checkpoint_inside_after_and_around_a_scope():
    blocks, x0 = _model(layers=2)
    params = [x0, *blocks.parameters()]

    def inside_and_after(use: bool) -> torch.Tensor:
        with _scope(use):
            h = tuc.checkpoint(blocks[0], x0, use_reentrant=False).sin()
        return tuc.checkpoint(blocks[1], h, use_reentrant=False)

    scopes = []

    def around(use: bool) -> torch.Tensor:
        def fn(x):
            with _scope(use) as s:
                y = blocks[0](x).cos()
            scopes.append(s)
            return blocks[1](y * 3)

        return tuc.checkpoint(fn, x0, use_reentrant=False)

    _grads_equal(inside_and_after, params)
    _assert_keeps_less(inside_and_after)
    _grads_equal(around, params)
    # torch's checkpoint keeps only x0 either way, but what y's ops save went to
    # the scope entered in forward, which replayed it (the recompute's did not).
    assert [s.record.stats()["replays"] for s in scopes if s is not None] == [1, 0]


# --- replay exactness ----------------------------------------------------------------


def test_autocast_cpu_bf16_bitwise():
    blocks, x0 = _model(layers=2)

    def loss(use: bool) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = x0
            for blk in blocks:
                with _scope(use):
                    x = blk(x)
                    with torch.autocast("cpu", enabled=False):
                        x = x.float().tanh()  # an fp32 island inside the scope
        return x.float()

    _grads_equal(loss, [x0, *blocks.parameters()])
    _assert_keeps_less(loss)


def test_double_backward_bitwise():
    def grads(use: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        a = torch.linspace(-1, 1, 6, requires_grad=True)
        with SavedBytesCounter() as count:
            with _scope(use):
                h = a.exp()  # exp saves its output: a handle
                t = h.tanh()
            y = (t * h).sum()
        (g,) = torch.autograd.grad(y, a, create_graph=True)
        (g2,) = torch.autograd.grad(g.pow(2).sum(), a)
        return g.detach(), g2, count.activation_bytes

    (g, g2, kept), (sg, sg2, scope_kept) = grads(False), grads(True)
    assert torch.equal(g, sg) and torch.equal(g2, sg2)
    assert (kept, scope_kept) == (2 * 6 * 4, 0)  # h and t, each 6 floats


def test_rng_explicit_generator_and_dropout():
    a = torch.randn(64, 64, requires_grad=True)

    def loss(use: bool) -> torch.Tensor:
        gen = torch.Generator().manual_seed(7)
        with _scope(use):
            h = F.dropout(a.exp(), 0.5)
            n = torch.randn(64, 64, generator=gen)
            h = h * n + torch.rand(64, 64)
        return h * a

    _grads_equal(loss, [a])
    _assert_keeps_less(loss)


def test_views_and_inplace_ops_inside_scope():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 16, 32, generator=g, requires_grad=True)
    w = torch.randn(32, 32, generator=g, requires_grad=True)

    def loss(use: bool) -> torch.Tensor:
        with _scope(use):
            h = x0 @ w
            v = h.view(-1, 32)
            v.mul_(2)  # in place through a view
            t = h.transpose(1, 2)
            t2 = t.sin().clone()
            t2.add_(1).relu_()
            z = torch.cat([t2, t], dim=1)
            s = z[:, :5].exp()
            first, second = z.chunk(2, dim=2)
            c = torch.view_as_complex(z.reshape(2, 64, 8, 2).contiguous())
        return (
            s.sum()
            + (first * second).sum()
            + (z * w.sum()).sum()
            + (c.conj() * c).real.sum()
        ).reshape(1)

    _grads_equal(loss, [x0, w])
    _assert_keeps_less(loss)


def test_outside_tensor_written_in_place_inside_scope():
    bn = nn.BatchNorm1d(16)
    x0 = torch.randn(2, 16, 32, requires_grad=True)

    def loss(use: bool) -> torch.Tensor:
        buf = torch.zeros(32)
        with _scope(use):
            h = bn(x0).tanh()
            buf.mul_(0.5).add_(h.detach().mean((0, 1)))
            h = h * buf
        return h * 2

    _grads_equal(loss, [x0, *bn.parameters()])
    _assert_keeps_less(loss)
    stats = []
    for use in (False, True):
        bn.reset_running_stats()
        loss(use).sum().backward()
        stats.append((bn.running_mean.clone(), bn.running_var.clone()))
    # Replay did not update the running statistics a second time.
    assert torch.equal(stats[0][0], stats[1][0]) and torch.equal(
        stats[0][1], stats[1][1]
    )
    assert bn.num_batches_tracked.item() == 1


def test_tensors_that_do_not_require_grad_and_no_grad():
    a = torch.randn(8, 8)
    w = torch.randn(8, 8, requires_grad=True)

    def loss(use: bool) -> torch.Tensor:
        with _Kept() as kept:
            with _scope(use):
                m = a.exp()  # requires no grad, but is saved by m * w
            y = m * w
        assert kept.holds(m) is not use
        return y

    _grads_equal(loss, [w])

    with torch.no_grad():
        with gradient_checkpoint_scope() as s:
            assert active_scope_depth() == 0
            y = w * 2
    assert s.record is None and type(y) is torch.Tensor


def test_scope_whose_tensors_are_not_used_later():
    a = torch.randn(8, requires_grad=True)
    with gradient_checkpoint_scope() as s:
        _ = (a * 2).sin()
    del _
    assert s.record.stats()["open"] is False and s.kept_bytes() == 0
    with gradient_checkpoint_scope() as s2:
        y = a + 1  # add saves nothing
    del y
    gc.collect()
    assert s2.record.stats()["open"] is False


def test_exception_inside_scope_cleans_state():
    a = torch.randn(8, requires_grad=True)
    with pytest.raises(ValueError):
        with gradient_checkpoint_scope():
            x = a.exp()
            raise ValueError("boom")
    assert active_scope_depth() == 0 and _no_hook_installed() and _no_dispatch_mode()
    # What was produced before the exception is still recomputed, not kept.
    with _Kept() as kept:
        y = x * a
    assert not kept.holds(x)
    y.sum().backward()
    assert torch.equal(a.grad, (a.exp() * a + a.exp()).detach())


def test_inplace_after_save_inside_scope_raises_like_autograd():
    a = torch.randn(8, requires_grad=True)
    with gradient_checkpoint_scope():
        h = a.exp()
        y = h * a  # saves h
        h.mul_(2)
    with pytest.raises(RematError, match="in-place"):
        y.sum().backward()
    with pytest.raises(RuntimeError, match="inplace"):  # plain autograd agrees
        h = a.exp()
        y = h * a
        h.mul_(2)
        y.sum().backward()


def test_outside_input_modified_before_backward_raises_clearly():
    a = torch.randn(8, requires_grad=True)
    src = torch.randn(8) * 1  # a non-leaf outside tensor
    with gradient_checkpoint_scope():
        h = (src * 3).exp()
    y = h * a
    src.add_(1)
    with pytest.raises(RematError, match="modified in place"):
        y.sum().backward()


def test_outside_tensor_saved_inside_scope_keeps_autograd_version_check():
    w = torch.randn(8, requires_grad=True)
    src = torch.randn(8) * 1
    with gradient_checkpoint_scope():
        y = src * w  # src is saved for w's gradient, as usual
    assert type(y) is ScopeOutput
    src.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_modified_outside_after_scope_is_saved_as_usual():
    a = torch.randn(8, requires_grad=True)
    with gradient_checkpoint_scope():
        h = a.exp()
        untouched = a.exp()
    h.mul_(2)  # now not what the scope computed: later saves keep it
    with _Kept() as kept:
        y = h * a
        z = untouched * a
    assert kept.holds(h) and not kept.holds(untouched)
    z.sum().backward()
    a.grad = None
    y.sum().backward()
    assert torch.allclose(a.grad, (2 * a.exp() * (a + 1)).detach())


def test_copy_and_pickle_of_scope_output_are_plain():
    with gradient_checkpoint_scope():
        t = torch.arange(4.0) * 2
    assert type(t) is ScopeOutput
    assert type(copy.deepcopy(t)) is torch.Tensor
    back = pickle.loads(pickle.dumps(t))
    assert type(back) is torch.Tensor and torch.equal(back, t)
    assert type(t) is ScopeOutput


def test_scope_object_is_single_use():
    s = gradient_checkpoint_scope()
    with s:
        pass
    with pytest.raises(RematUsageError, match="new one"):
        with s:
            pass
