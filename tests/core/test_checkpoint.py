"""Core runtime: save regions, placeholders, persistence, state hooks, errors."""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from typing import NamedTuple

import pytest
import torch
import torch.utils.checkpoint as tuc

import remat_dist as remat
from remat_dist.core import SavedTensorKind, live_records
from remat_dist.core._checkpoint import _UnsupportedOption
from remat_dist.testing import SavedBytesCounter


def _param(*shape: int, seed: int) -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(*shape, generator=g) / shape[0] ** 0.5)


W1, W2, W3 = _param(8, 8, seed=1), _param(8, 8, seed=2), _param(8, 8, seed=3)
PARAMS = [W1, W2, W3]


def _grads(fn, x0: torch.Tensor) -> list[torch.Tensor]:
    for p in PARAMS:
        p.grad = None
    x = x0.detach().requires_grad_()
    fn(x).pow(2).sum().backward()
    return [x.grad] + [torch.zeros(0) if p.grad is None else p.grad.clone() for p in PARAMS]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@contextlib.contextmanager
def _raises(cls: type[BaseException], *fragments: str):
    """Like ``pytest.raises``, for exactly ``cls`` (not a subclass) with every
    fragment in the message. Keeps no reference to the exception afterwards (its
    traceback would keep the failed checkpoint's record alive)."""
    try:
        yield
    except cls as exc:
        assert type(exc) is cls, type(exc)
        msg = str(exc)
    else:
        pytest.fail(f"DID NOT RAISE {cls.__name__}")
    missing = [f for f in fragments if f not in msg]
    assert not missing, f"{missing} not in {msg!r}"


X0 = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def chain(x, keep=(), needs=True):
    """Three matmul+tanh stages; ``keep`` names the stages kept as save regions."""
    for i, w in enumerate(PARAMS):
        stage = remat.region(lambda t, w=w: (t @ w).tanh(), f"s{i}", recompute=f"s{i}" not in keep)
        y = stage(x)
        if needs:
            remat.recompute_needs_tensor(y)
        x = x + y
    return x


@pytest.mark.parametrize("keep", [(), ("s0",), ("s1",), ("s0", "s1"), ("s0", "s1", "s2")])
def test_gradients_bitwise_equal_no_checkpoint(keep):
    ref = _grads(chain, X0)
    got = _grads(lambda x: remat.checkpoint(region_name="c")(chain)(x, keep=keep), X0)
    assert _equal(ref, got)


def test_chain_of_save_regions_needs_no_persistence():
    # s1 consumes s0's output; both are skipped on replay, so s0's output is
    # served as a placeholder that only flows into skipped s1.
    def f(x):
        a = remat.region(lambda t: t @ W1, "a", recompute=False)(x)
        b = remat.region(lambda t: (t @ W2).tanh(), "b", recompute=False)(a)
        remat.recompute_needs_tensor(b)
        return (b @ W3).sin()

    seen = []

    def probe(t):
        seen.append(remat.is_placeholder(t))
        return t

    def f_probe(x):
        a = remat.region(lambda t: t @ W1, "a", recompute=False)(x)
        probe(a)
        b = remat.region(lambda t: (t @ W2).tanh(), "b", recompute=False)(a)
        remat.recompute_needs_tensor(b)
        return (b @ W3).sin()

    assert _equal(_grads(f, X0), _grads(lambda x: remat.checkpoint(region_name="c")(f)(x), X0))
    _grads(lambda x: remat.checkpoint(region_name="c")(f_probe)(x), X0)
    assert seen == [False, True]  # forward: real tensor; replay: placeholder
    rec_bytes = []
    out = remat.checkpoint(region_name="c")(f)(X0.clone().requires_grad_())
    rec = [r for r in live_records() if r.name == "c"][-1]
    rec_bytes.append({r.local_name: sorted(r.persisted) for r in rec.regions})
    out.sum().backward()
    # a: nothing persisted (its consumer is skipped); b: persisted for the bare matmul
    assert rec_bytes == [{"a": [], "b": [0]}]


def test_unused_and_returned_save_outputs_are_placeholders_on_replay():
    def f(x):
        y, unused = remat.region(
            lambda t: ((t @ W1).tanh(), t @ W2), "two", recompute=False
        )(x)
        z = (x @ W3).sin()
        return z, y

    ref = _grads(lambda x: sum(t.sum() for t in f(x)), X0)
    got = _grads(
        lambda x: sum(t.sum() for t in remat.checkpoint(region_name="c")(f)(x)), X0
    )
    assert _equal(ref, got)


def test_placeholder_read_error_names_region_and_fixes():
    def f(x):
        y = remat.region(lambda t: t @ W1, "proj", recompute=False)(x)
        return (x + y).tanh()  # bare consumer, not persisted

    out = remat.checkpoint(region_name="layers.3")(f)(X0.clone().requires_grad_())
    with _raises(
        remat.errors.PlaceholderAccessError,
        "the replay of checkpoint 'layers.3' read the data of output 0 of save "
        "region 'layers.3::proj'",
        "Fix: call remat_dist.recompute_needs_tensor(output)",
        "inside a remat_dist.region(...) call",
    ):
        out.sum().backward()


def test_placeholder_read_in_a_gradient_formula_says_backward():
    """cos saves its input on the replay (the skipped region's placeholder) and its
    backward computes sin of it: the error says backward read it there, not the
    replay, which would point at the region's own op."""

    def f(x):
        return remat.region(torch.sin, "s", recompute=False)(x).cos()

    out = remat.checkpoint(region_name="L0")(f)(X0.clone().requires_grad_())
    with _raises(
        remat.errors.PlaceholderAccessError,
        "backward, after the replay of checkpoint 'L0', read (in the gradient formula",
        "region 'L0::s'",
        "Fix: call remat_dist.recompute_needs_tensor(output)",
    ):
        out.sum().backward()


def test_region_consumer_persists_automatically():
    def f(x):
        y = remat.region(lambda t: t @ W1, "proj", recompute=False)(x)
        return remat.region(lambda t: (x + t).tanh(), "post", recompute=True)(y)

    assert _equal(
        _grads(f, X0), _grads(lambda x: remat.checkpoint(region_name="c")(f)(x), X0)
    )


def test_output_saved_by_backward_is_persisted_for_free():
    # tanh saves its own output: replay can read it without recompute_needs_tensor
    def f(x):
        y = remat.region(lambda t: (t @ W1).tanh(), "act", recompute=False)(x)
        return (x * y).sin()

    out = remat.checkpoint(region_name="c")(f)(X0.clone().requires_grad_())
    rec = [r for r in live_records() if r.name == "c"][-1]
    kept = rec.regions[0].persisted[0]
    assert kept.free and kept.nbytes == 0
    out.sum().backward()
    assert _equal(_grads(f, X0), _grads(lambda x: remat.checkpoint(region_name="c")(f)(x), X0))


def test_view_of_save_output_resolves_to_producer():
    def f(x):
        y = remat.region(lambda t: t @ W1, "proj", recompute=False)(x)
        v = y.view(2, 16)
        remat.recompute_needs_tensor(v)
        return (v.sin() * 2).view(4, 8) + x

    assert _equal(
        _grads(f, X0), _grads(lambda x: remat.checkpoint(region_name="c")(f)(x), X0)
    )


def test_in_place_on_saved_tensor_raises_like_autograd():
    def inner(t):
        u = t * 2
        return u * W1[0], u  # mul saves u, which the region creates (kept)

    def f(x):
        y, u = remat.region(inner, "mul", recompute=False)(x)
        u.add_(1)
        return y * 2

    out = remat.checkpoint(region_name="c")(f)(X0.clone().requires_grad_())
    with _raises(
        remat.RematError,
        "modified by an inplace operation",
        "saved by save region 'c::mul' (checkpoint 'c')",
        "Fix: clone the tensor",
    ):
        out.sum().backward()


def test_save_region_inputs_are_recomputed_not_kept():
    # the region's input x is recomputed by replay anyway: it is not kept, and an
    # in-place change after the region does not matter (torch.utils.checkpoint's
    # semantics for recomputed tensors)
    def f(x):
        x = x * 1
        y = remat.region(lambda t: t * W1[0], "mul", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        x.add_(1)
        return y * 2 + x.sin()

    ref = _grads(lambda x: tuc.checkpoint(f, x, use_reentrant=False), X0)
    assert _equal(ref, _grads(lambda x: remat.checkpoint(region_name="c")(f)(x), X0))
    out = remat.checkpoint(region_name="c")(f)(X0.clone().requires_grad_())
    rec = [r for r in live_records() if r.name == "c"][-1]
    assert [e.shape for e in rec.regions[0].saved] == [(8,)]  # only W1[0]'s view
    assert len(rec.regions[0].routed) == 1
    out.sum().backward()


def test_in_place_on_persisted_output_raises_with_region():
    def f(x):
        y = remat.region(lambda t: t @ W1, "mul", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        y.mul_(2)
        return y.sin()

    out = remat.checkpoint(region_name="c")(f)(X0.clone().requires_grad_())
    with _raises(
        remat.RematError,
        "output 0 of save region 'c::mul' (checkpoint 'c') was modified in place",
        "Fix: clone it",
    ):
        out.sum().backward()


def test_input_changed_in_place_inside_the_region_is_kept():
    # replay skips the region, so it cannot redo the change: the changed input
    # must be kept, not recomputed
    def f(x):
        h = x.cos()
        y = remat.region(lambda t: inner_inplace(t), "mul", recompute=False)(h)
        remat.recompute_needs_tensor(y)
        return y * 2

    def inner_inplace(t):
        t.mul_(3)  # the region's own input, changed before mul saves it
        return (t * W1[0]).sin()

    ref = _grads(f, X0)
    assert _equal(ref, _grads(lambda x: remat.checkpoint(region_name="c")(f)(x), X0))
    out = remat.checkpoint(region_name="c")(f)(X0.clone().requires_grad_())
    rec = [r for r in live_records() if r.name == "c"][-1]
    assert rec.regions[0].routed == []
    out.sum().backward()


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor | None


def test_kwargs_multiple_outputs_none_namedtuple_and_no_grad_inputs():
    def f(x, m, *, scale, bias=None):
        y, none = remat.region(lambda t: ((t @ W1).tanh(), None), "r", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        return Pair(y * scale + m, None), (y @ W2).sin() + bias

    m = torch.randn(4, 8)  # does not require grad
    s = torch.tensor(3.0)
    bias = torch.randn(8)

    def loss(fn):
        return lambda x: (lambda o: o[0].a.sum() + o[1].sum())(fn(x, m, scale=s, bias=bias))

    ck = remat.checkpoint(region_name="c")(f)
    out = ck(X0.clone().requires_grad_(), m, scale=s, bias=bias)
    assert isinstance(out[0], Pair) and out[0].b is None
    assert _equal(_grads(loss(f), X0), _grads(loss(ck), X0))


def _saved_bytes(run) -> int:
    """Bytes backward will need, by the independent counter (checkpoint inputs,
    save-region saves and persisted outputs included; parameters apart)."""
    with SavedBytesCounter(PARAMS) as count:
        out = run()
    out.sum().backward()
    return count.activation_bytes


def test_saved_bytes_all_recompute_equal_torch_checkpoint():
    x = X0.clone().requires_grad_()
    ours = _saved_bytes(lambda: remat.checkpoint(region_name="c")(chain)(x))
    theirs = _saved_bytes(lambda: tuc.checkpoint(chain, x, use_reentrant=False))
    assert ours == theirs == x.nbytes


def test_saved_bytes_save_region_equal_plan():
    x = X0.clone().requires_grad_()
    # plan: the checkpoint input + what stage s1 keeps: its tanh output (== the
    # region output, so persisting it for the residual add is free). Its matmul
    # input is the region's input, which replay recomputes: not kept.
    ours = _saved_bytes(lambda: remat.checkpoint(region_name="c")(chain)(x, keep=("s1",)))
    assert ours == x.nbytes + X0.nbytes


def test_pack_hook_kinds():
    kinds = []

    def pack(t):
        info = remat.current_saved_tensor_info()
        kinds.append((info.kind, info.checkpoint, info.region))
        return t

    def f(x):
        y = remat.region(lambda t: t @ W1, "proj", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        return y.sin()

    x = X0.clone().requires_grad_()
    with remat.saved_tensors_hooks(pack, lambda t: t):
        out = remat.checkpoint(region_name="c")(f)(x).exp()
    assert (SavedTensorKind.CHECKPOINT_INPUT, "c", None) in kinds
    assert (SavedTensorKind.BACKWARD, "c", "c::proj") in kinds
    assert (SavedTensorKind.SAVE_OUTPUT, "c", "c::proj") in kinds
    assert (SavedTensorKind.BACKWARD, None, None) in kinds  # exp outside
    out.sum().backward()
    with _raises(
        remat.RematUsageError,
        "current_saved_tensor_info() was called outside a pack hook",
        "Fix: call it only from the pack function",
    ):
        remat.current_saved_tensor_info()


def test_cpu_offload_through_saved_tensors_hooks():
    moved = []

    def pack(t):
        moved.append(t.nbytes)
        return t.to("cpu", copy=True)

    ref = _grads(lambda x: chain(x, keep=("s0", "s2")), X0)
    with remat.saved_tensors_hooks(pack, lambda t: t):
        got = _grads(
            lambda x: remat.checkpoint(region_name="c")(chain)(x, keep=("s0", "s2")), X0
        )
    assert _equal(ref, got) and moved


def test_named_save_for_backward_names_reach_pack_hook():
    class Sq(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x * x
            remat.save_for_backward(ctx, {"copy": x.clone(), "gf": 2 * x})
            return y

        @staticmethod
        def backward(ctx, g):
            _, gf = ctx.saved_tensors
            return g * gf

    names = []

    def pack(t):
        names.append(remat.current_saved_tensor_info().name)
        return t

    def f(x):
        y = remat.region(Sq.apply, "sq", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        return y.sin()

    with remat.saved_tensors_hooks(pack, lambda t: t):
        out = remat.checkpoint(region_name="c")(f)(X0.clone().requires_grad_())
    assert {"copy", "gf"} <= set(names)
    out.sum().backward()


class Counter:
    """A state hook over a Python counter, logging every call."""

    def __init__(self):
        self.value = 0
        self.log = []

    def snapshot(self):
        self.log.append(("snapshot", self.value))
        return self.value

    def restore(self, state):
        self.log.append(("restore", state))
        self.value = state


def test_state_hooks_called_at_documented_points():
    hook = Counter()

    def f(x):
        hook.value += 1
        a = remat.region(lambda t: (t @ W1).tanh(), "a", recompute=False)(x)
        hook.value += 10  # drawn after the save region
        b = remat.region(lambda t: (t @ W2).tanh(), "b", recompute=False)(a)
        remat.recompute_needs_tensor(b)
        hook.value += 100
        return (b @ W3).sin()

    out = remat.checkpoint(region_name="c", recompute_state_hooks=(hook,))(f)(X0.clone().requires_grad_())
    assert hook.log == [("snapshot", 0), ("snapshot", 1), ("snapshot", 11)]
    hook.log.clear()
    hook.value = 999  # state at backward time
    out.sum().backward()
    # replay: outside state saved, entry restored, after-a and after-b restored,
    # outside state put back
    assert hook.log == [
        ("snapshot", 999),
        ("restore", 0),
        ("restore", 1),
        ("restore", 11),
        ("restore", 999),
    ]
    assert hook.value == 999


def test_dropout_with_cpu_rng_hook_bitwise():
    class CPURNG:
        def snapshot(self):
            return torch.get_rng_state()

        def restore(self, s):
            torch.set_rng_state(s)

    def f(x):
        x = torch.nn.functional.dropout(x @ W1, 0.3)
        y = remat.region(lambda t: torch.nn.functional.dropout((t @ W2).tanh(), 0.5), "d", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        return torch.nn.functional.dropout(y @ W3, 0.2)

    torch.manual_seed(5)
    ref = _grads(f, X0)
    after_ref = torch.get_rng_state()
    torch.manual_seed(5)
    got = _grads(
        lambda x: remat.checkpoint(region_name="c", recompute_state_hooks=(CPURNG(),))(f)(x), X0
    )
    assert _equal(ref, got)
    assert torch.equal(after_ref, torch.get_rng_state())


def test_snapshot_error_names_region():
    class Bad:
        def snapshot(self):
            raise ValueError("boom")

        def restore(self, s):
            pass

    with _raises(
        remat.RematError,
        "Bad.snapshot() raised ValueError('boom') in checkpoint 'layers.1'",
        "Fix the hook",
    ):
        remat.checkpoint(region_name="layers.1", recompute_state_hooks=(Bad(),))(chain)(X0.clone().requires_grad_())


def test_is_recomputing_only_during_replay():
    seen = []

    def f(x):
        seen.append(remat.is_recomputing())
        return (x @ W1).tanh()

    out = remat.checkpoint(region_name="c")(f)(X0.clone().requires_grad_())
    assert not remat.is_recomputing()
    out.sum().backward()
    assert seen == [False, True] and not remat.is_recomputing()


def test_early_stop_skips_trailing_code():
    calls = []

    def f(x):
        y = (x @ W1).tanh()
        calls.append("tail-start")
        return y * 2  # mul by a python scalar saves nothing

    out = remat.checkpoint(region_name="c")(f)(X0.clone().requires_grad_())
    out.sum().backward()
    assert calls == ["tail-start"]  # replay stopped before reaching the tail


def test_record_and_persisted_freed_after_backward_and_no_growth():
    def f(x):
        y = remat.region(lambda t: t @ W1, "p", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        return y.sin()

    x = X0.clone().requires_grad_()
    out = remat.checkpoint(region_name="life")(f)(x)
    rec = weakref.ref([r for r in live_records() if r.name == "life"][-1])
    kept = weakref.ref(rec().regions[0].persisted[0].packed)
    out.sum().backward()
    assert rec() is None and kept() is None
    gc.collect()
    base = len(live_records())
    for _ in range(50):
        remat.checkpoint(region_name="life")(f)(x).sum().backward()
    assert len(live_records()) == base


def test_retain_graph_second_backward_replays_identically():
    x = X0.clone().requires_grad_()
    out = remat.checkpoint(region_name="c")(chain)(x, keep=("s1",))
    out.pow(2).sum().backward(retain_graph=True)
    g1 = x.grad.clone()
    x.grad = None
    out.pow(2).sum().backward()
    assert torch.equal(g1, x.grad)


def test_name_scope_allows_repeated_subblocks():
    def f(x):
        for i in range(2):
            with remat.name_scope(f"part{i}"):
                x = x + remat.region(lambda t: (t @ W1).tanh(), "ffn", recompute=False)(x)
        return x

    out = remat.checkpoint(region_name="c")(f)(X0.clone().requires_grad_())
    rec = [r for r in live_records() if r.name == "c"][-1]
    assert [r.name for r in rec.regions] == ["c::part0/ffn", "c::part1/ffn"]
    out.sum().backward()


def test_threads_do_not_see_each_other():
    errors = []
    barrier = threading.Barrier(2)

    def work(keep):
        try:
            for _ in range(5):
                def f(x):
                    barrier.wait(timeout=10)
                    return chain(x, keep=keep)

                got = _grads_local(lambda x: remat.checkpoint(region_name=f"t{keep}")(f)(x))
                ref = _grads_local(lambda x: chain(x, keep=keep))
                assert all(torch.equal(a, b) for a, b in zip(got, ref))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def _grads_local(fn):
        x = X0.clone().requires_grad_()
        (gx,) = torch.autograd.grad(fn(x).pow(2).sum(), [x])
        return [gx]

    threads = [threading.Thread(target=work, args=(k,)) for k in [("s0",), ("s1", "s2")]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def _penalised(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w)
    # a gradient penalty inside the checkpointed function: its backward replays
    # the checkpoint while the checkpoint's forward still runs
    (g,) = torch.autograd.grad(h.pow(2).sum(), x, create_graph=True)
    return (h * h).sum(-1) + g.pow(2).sum(-1)


@pytest.mark.parametrize("early_stop", [True, False])
def test_a_backward_inside_the_forward_gives_the_gradients_of_no_checkpoint(early_stop):
    def grads(fn):
        torch.manual_seed(0)
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)
        with tuc.set_checkpoint_early_stop(early_stop):
            fn(x, w).sum().backward()
        return x.grad, w.grad

    ref = grads(_penalised)
    got = grads(remat.checkpoint(region_name="layers.0")(_penalised))
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


# --- bad input: each a clear error at the call, naming the region and the fix ---


def test_positional_fn_raises_type_error_with_fix():
    with _raises(
        remat.RematUsageError,
        "remat_dist.checkpoint(chain) is torch.utils.checkpoint.checkpoint's call shape",
        "Write: remat_dist.checkpoint(region_name='layers.0')(chain)(*args)",
    ):
        remat.checkpoint(chain)
    with pytest.raises(TypeError):  # what torch.utils.checkpoint users catch
        remat.checkpoint(chain)


def test_preserve_rng_state_names_state_hooks():
    # torch_remat raises NotImplementedError here; ours is also a RematUsageError
    with pytest.raises(NotImplementedError) as info:
        remat.checkpoint(region_name="layers.0", preserve_rng_state=True)
    assert isinstance(info.value, remat.RematUsageError)
    assert "layers.0" in str(info.value)
    assert "recompute_state_hooks=remat_dist.distributed.default_state_hooks()" in str(
        info.value
    )


def test_nested_checkpoint_refused_at_entry():
    inner = remat.checkpoint(region_name="inner")(chain)
    with _raises(
        _UnsupportedOption,  # a RematUsageError and torch_remat's NotImplementedError
        "checkpoint(region_name='inner') was entered inside checkpoint 'outer'",
        "Fix: checkpoint the outer block only",
        "remat_dist.region(fn, 'inner', recompute=True)",
    ):
        remat.checkpoint(region_name="outer")(inner)(X0.clone().requires_grad_())


def test_duplicate_region_name_names_fix():
    def f(x):
        x = remat.region(torch.tanh, "act", recompute=False)(x)
        return remat.region(torch.tanh, "act", recompute=False)(x)

    with _raises(
        remat.RematUsageError,
        "region 'act' was entered twice in one forward of checkpoint 'blk'",
        "Fix: give each call its own name",
        "remat_dist.name_scope('part0')",
    ):
        remat.checkpoint(region_name="blk")(f)(X0.clone().requires_grad_())


@pytest.mark.parametrize(
    "out, what",
    [
        (lambda t: {"y": t}, "dict"),
        (lambda t: ((t, t),), "tuple containing a tuple"),
        (lambda t: (t, 3), "tuple containing a int"),
        (lambda t: 3.0, "float"),
    ],
)
def test_bad_region_outputs(out, what):
    def f(x):
        return remat.region(lambda t: out(t * 2), "bad", recompute=False)(x)

    with _raises(
        remat.RematUsageError,
        f"region 'c::bad' returned a {what};",
        "Fix: return a tuple of tensors",
    ):
        remat.checkpoint(region_name="c")(f)(X0.clone().requires_grad_())


def test_recompute_inside_save_region_refused():
    def f(x):
        def outer(t):
            return remat.region(torch.tanh, "inner", recompute=True)(t)

        return remat.region(outer, "outer", recompute=False)(x)

    with _raises(
        remat.RematUsageError,
        "region 'c::inner' (recompute=True) is nested inside save region 'c::outer'",
        "Fix: move the recompute region out of the save region",
    ):
        remat.checkpoint(region_name="c")(f)(X0.clone().requires_grad_())


@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_non_bool_recompute(bad):
    with _raises(
        remat.RematUsageError,
        "remat_dist.region(fn, 'act', recompute=...): recompute must be True or False, "
        f"got {bad!r} ({type(bad).__name__})",
    ):
        remat.region(torch.tanh, "act", recompute=bad)


@pytest.mark.parametrize("bad", ["", None, 3])
def test_empty_or_non_string_names(bad):
    with _raises(
        remat.RematUsageError,
        f"remat_dist.region: name must be a non-empty string, got {bad!r}",
        "Fix: name the call after what it computes",
    ):
        remat.region(torch.tanh, bad, recompute=False)
    if bad is not None:
        with _raises(
            remat.RematUsageError,
            f"region_name must be a non-empty string, got {bad!r}",
            "Fix: name it after the module, e.g. 'layers.0'",
        ):
            remat.checkpoint(region_name=bad)


def test_region_outside_checkpoint_is_plain_call():
    y = remat.region(torch.tanh, "act", recompute=False)(X0)
    assert torch.equal(y, torch.tanh(X0))
    remat.recompute_needs_tensor(y)  # no-op outside a forward


def test_no_grad_runs_plainly():
    with torch.no_grad():
        y = remat.checkpoint(region_name="c")(chain)(X0, keep=("s0",))
    assert torch.equal(y, chain(X0, keep=("s0",)))


def test_replay_divergence_is_an_error():
    flag = {"n": 0}

    def f(x):
        flag["n"] += 1
        name = "a" if flag["n"] == 1 else "b"
        return remat.region(lambda t: (t @ W1).tanh(), name, recompute=True)(x)

    out = remat.checkpoint(region_name="c")(f)(X0.clone().requires_grad_())
    with _raises(
        remat.RematError,
        "the replay of checkpoint 'c' entered region 'c::b' (recompute=True) where "
        "the forward had region 'c::a' (recompute=True)",
        "Fix: make control flow depend only on the inputs",
    ):
        out.sum().backward()


def test_checkpoint_saved_tensors_hooks_option_sees_what_the_checkpoint_keeps():
    seen = []

    def pack(t):
        seen.append(remat.current_saved_tensor_info().kind)
        return t.clone()

    x = X0.clone().requires_grad_()
    ck = remat.checkpoint(region_name="c", saved_tensors_hooks=(pack, lambda t: t))
    out = ck(chain)(x, keep=("s1",))
    assert SavedTensorKind.CHECKPOINT_INPUT in seen and SavedTensorKind.BACKWARD in seen
    out.pow(2).sum().backward()
    ref = _grads(lambda t: chain(t, keep=("s1",)), X0)
    got = _grads(lambda t: ck(chain)(t, keep=("s1",)), X0)
    assert _equal(ref, got)
    with _raises(
        remat.RematUsageError,
        "checkpoint(region_name='c'): saved_tensors_hooks must be a "
        "remat_dist.saved_tensors_hooks(pack, unpack) or a (pack, unpack) tuple, "
        "got function",
    ):
        remat.checkpoint(region_name="c", saved_tensors_hooks=lambda t: t)


def test_determinism_check_per_tensor_catches_a_replay_with_other_shapes():
    calls = {"n": 0}

    def f(x):
        calls["n"] += 1
        n = 4 if calls["n"] == 1 else 3  # replay sees another shape
        return (x[:n] @ W1).tanh()

    out = remat.checkpoint(region_name="c", determinism_check="metadata_per_tensor")(f)(X0.clone().requires_grad_())
    # remat_dist's check runs first, at the saved tensor that differs, and names the
    # checkpoint; its error is also torch's CheckpointError (code catching that
    # still does)
    with _raises(
        remat.errors.ReplayMismatchError,
        "the replay of checkpoint 'c' did not reproduce its forward: saved tensor #1",
        "forward: shape (4, 8)",
        "replay:  shape (3, 8)",
    ):
        out.sum().backward()
    assert issubclass(remat.errors.ReplayMismatchError, tuc.CheckpointError)
    with _raises(
        remat.RematUsageError,
        "checkpoint(region_name='c'): determinism_check must be one of "
        "('metadata', 'metadata_per_tensor', 'values') (or torch's names "
        "('none', 'default')), got 'strict'",
    ):
        remat.checkpoint(region_name="c", determinism_check="strict")


def test_region_collectives_option_is_validated():
    with _raises(
        remat.RematUsageError,
        "remat_dist.region(fn, 'act', ...): collectives must be one of "
        "('replay', 'save'), got 'never'",
    ):
        remat.region(torch.tanh, "act", recompute=True, collectives="never")
    with _raises(
        remat.RematUsageError,
        "remat_dist.checkpoint(region_name='c'): collectives must be one of "
        "('replay', 'save'), got 'sometimes'",
    ):
        remat.checkpoint(region_name="c", collectives="sometimes")


def test_save_region_does_not_keep_its_inputs_alive():
    # its input is recomputed by replay: after forward nothing may hold it (autograd
    # keeps the region's pack hook as long as the saved tensors)
    seen = {}

    def f(x):
        h = x.cos()
        seen["h"] = weakref.ref(h)
        y = remat.region(lambda t: (t @ W1).sin(), "proj", recompute=False)(h)
        remat.recompute_needs_tensor(y)
        return y * 2

    out = remat.checkpoint(region_name="c")(f)(X0.clone().requires_grad_())
    gc.collect()
    assert seen["h"]() is None
    out.sum().backward()
    assert _equal(_grads(f, X0), _grads(lambda x: remat.checkpoint(region_name="c")(f)(x), X0))


def test_every_torch_remat_public_name_is_here():
    # a user switches with one import line: torch_remat 0.2's public names
    names = (
        "checkpoint region recompute_needs_tensor is_placeholder is_recomputing "
        "RecomputeStateHook save_for_backward saved_tensors_hooks "
        "current_saved_tensor_info SavedTensorInfo SavedTensorKind collect_trace "
        "trace_scope format_current_memory_report print_current_memory_report "
        "format_saved_tensors_report print_saved_tensors_report oom_observer "
        "format_oom_saved_tensors_report discover_autograd_roots "
        "memory_snapshot_annotate clear_memory_snapshot_cache"
    ).split()
    assert [n for n in names if not hasattr(remat, n)] == []


def test_in_place_on_checkpoint_output_is_allowed_like_torch_checkpoint():
    def run(ck):
        x = X0.clone().requires_grad_()
        y = ck(x)
        y.mul_(2)  # torch_remat's output is a view and raises here
        y.sum().backward()
        return x.grad

    ours = run(lambda x: remat.checkpoint(region_name="c")(chain)(x, keep=("s1",)))
    theirs = run(lambda x: tuc.checkpoint(lambda t: chain(t, keep=("s1",)), x, use_reentrant=False))
    assert torch.equal(ours, theirs)
