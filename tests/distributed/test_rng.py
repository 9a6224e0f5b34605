"""RNG state hooks in one process: round trips, replay exactness, costs, errors.

The multi-rank checks (tensor parallelism over gloo) are in test_rng_tp.py; the CUDA
ones at the bottom are marked ``gpu`` and run by scripts/gpu_check.sh.
"""

from __future__ import annotations

import pytest
import torch

import remat_dist as remat
from remat_dist.core import _record
from remat_dist.distributed import (
    default_state_hooks,
    install_default_provider,
    rank_device,
)
from remat_dist.distributed._rng import (
    PHILOX_SNAPSHOT_NBYTES,
    CPURNGStateHook,
    DeviceRNGStateHook,
    DTensorRNGStateHook,
    GeneratorStateHook,
    PhiloxState,
)

CPU_STATE_NBYTES = 5056  # MT19937: 624 words + position + seed + cached normals
HAS_ACCELERATOR = torch.accelerator.is_available()
cpu_only = pytest.mark.skipif(HAS_ACCELERATOR, reason="checks the CPU-only resolution")


@pytest.fixture
def restore_provider():
    """Put back whatever default-hooks provider was installed before the test."""
    saved = _record._SEAMS.hooks_provider
    yield
    _record.set_default_state_hooks_provider(saved)


def _round_trip(hook, draw) -> None:
    state = hook.snapshot()
    first = draw()
    draw()  # move further, so restore has to undo more than one draw
    hook.restore(state)
    assert torch.equal(draw(), first)
    hook.restore(state)  # a snapshot can be restored twice (retain_graph replays)
    assert torch.equal(draw(), first)


def test_cpu_hook_round_trip():
    _round_trip(CPURNGStateHook(), lambda: torch.rand(7))


def test_cpu_hook_round_trip_keeps_cached_normal():
    # randn of odd length leaves a cached normal sample in the CPU generator's state.
    hook = CPURNGStateHook()
    torch.randn(1, dtype=torch.float64)
    _round_trip(hook, lambda: torch.randn(3, dtype=torch.float64))


def test_generator_hook_round_trip_user_generator():
    gen = torch.Generator().manual_seed(11)
    before = torch.default_generator.get_state()
    _round_trip(GeneratorStateHook(gen), lambda: torch.rand(5, generator=gen))
    assert torch.equal(torch.default_generator.get_state(), before)


def test_generator_hook_subclass_keeps_its_own_snapshot_and_restore():
    # CPU generator hooks snapshot through the generator's own methods (no Python
    # frame per checkpoint); a subclass overriding either must still be called
    calls = []

    class Counting(GeneratorStateHook):
        def snapshot(self):
            calls.append("snapshot")
            return super().snapshot()

        def restore(self, state):
            calls.append("restore")
            super().restore(state)

    gen = torch.Generator().manual_seed(3)
    out = remat.checkpoint(region_name="c", recompute_state_hooks=(Counting(gen),))(
        lambda x: x * torch.rand(4, generator=gen)
    )(torch.ones(4, requires_grad=True))
    out.sum().backward()
    # entry; replay: outside snapshot, entry restore, outside restore
    assert calls == ["snapshot", "snapshot", "restore", "restore"]


def test_device_hook_round_trip():
    hook = DeviceRNGStateHook()
    _round_trip(hook, lambda: torch.rand(6, device=hook.device))


def test_dtensor_hook_round_trip():
    for device_type in (None, "cpu"):
        hook = DTensorRNGStateHook(device_type=device_type)
        if HAS_ACCELERATOR and device_type is None:
            acc = torch.accelerator.current_accelerator()
            dev = torch.device(acc.type, torch.accelerator.current_device_index())
        else:
            dev = torch.device("cpu")
        _round_trip(hook, lambda dev=dev: torch.rand(4, device=dev))


class _FakeTracker:
    """Stands in for DTensor's tracker: only its flag is state of its own."""

    def __init__(self) -> None:
        self.distribute_region_enabled = True
        self._device = torch.device("cpu")


def test_dtensor_hook_restores_tracker_flag(monkeypatch):
    from torch.distributed.tensor import _random as dt_random

    tracker = _FakeTracker()
    monkeypatch.setattr(dt_random, "_rng_tracker", tracker)
    hook = DTensorRNGStateHook()
    tracker.distribute_region_enabled = False
    state = hook.snapshot()
    assert state.had_tracker and state.distribute_region_enabled is False
    tracker.distribute_region_enabled = True
    hook.restore(state)
    assert tracker.distribute_region_enabled is False


def test_dtensor_hook_warns_when_tracker_appeared_since_snapshot(monkeypatch):
    from torch.distributed.tensor import _random as dt_random

    monkeypatch.setattr(dt_random, "_rng_tracker", None)
    hook = DTensorRNGStateHook()
    state = hook.snapshot()
    assert not state.had_tracker and state.distribute_region_enabled is None
    hook.restore(state)  # still no tracker: nothing to say
    monkeypatch.setattr(dt_random, "_rng_tracker", _FakeTracker())
    with pytest.warns(RuntimeWarning, match="tracker was created inside"):
        hook.restore(state)


def test_generator_hook_rejects_non_generator():
    with pytest.raises(TypeError, match="torch.Generator"):
        GeneratorStateHook(torch.default_generator.get_state())  # type: ignore[arg-type]


@cpu_only
def test_device_hook_on_cpu_picks_cpu_generator(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")  # no accelerator: LOCAL_RANK is irrelevant
    hook = DeviceRNGStateHook()
    assert hook.device == torch.device("cpu")
    assert hook.generator is torch.default_generator


def test_snapshot_sizes_in_bytes():
    cpu = CPURNGStateHook()
    assert cpu.nbytes(cpu.snapshot()) == CPU_STATE_NBYTES
    user = GeneratorStateHook(torch.Generator().manual_seed(3))
    assert user.nbytes(user.snapshot()) == CPU_STATE_NBYTES
    dev = DeviceRNGStateHook("cpu")
    assert dev.nbytes(dev.snapshot()) == CPU_STATE_NBYTES
    dt = DTensorRNGStateHook(device_type="cpu")  # alone, it covers the CPU generator
    assert dt.nbytes(dt.snapshot()) == CPU_STATE_NBYTES
    skip = DTensorRNGStateHook(device_type="cpu", exclude_devices=("cpu",))
    state = skip.snapshot()
    assert state.generators == () and skip.nbytes(state) == 0


@cpu_only
def test_default_state_hooks_on_cpu_is_one_cpu_hook():
    for hooks in (default_state_hooks(), default_state_hooks(cpu=True)):
        assert len(hooks) == 1
        (hook,) = hooks
        assert isinstance(hook, DeviceRNGStateHook)
        assert hook.generator is torch.default_generator
        assert sum(h.nbytes(h.snapshot()) for h in hooks) == CPU_STATE_NBYTES


def test_provider_without_process_group_keeps_the_cpu_generator(restore_provider):
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    install_default_provider()
    hooks = _record._SEAMS.hooks_provider()
    assert isinstance(hooks[0], CPURNGStateHook)
    if not torch.cuda.is_initialized():
        assert len(hooks) == 1


def test_default_checkpoint_replays_dropout_exactly_in_one_process():
    # no hooks passed: the default keeps the CPU generator, gradients are exact
    def f(x):
        return torch.nn.functional.dropout(x @ W, 0.5).tanh()

    torch.manual_seed(3)
    x = X0.clone().requires_grad_()
    f(x).sum().backward()
    ref = x.grad
    torch.manual_seed(3)
    x = X0.clone().requires_grad_()
    remat.checkpoint(region_name="c")(f)(x).sum().backward()
    assert torch.equal(ref, x.grad)


# --- replay exactness through remat_dist.checkpoint --------------------------------

W = torch.nn.Parameter(
    torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) / 3
)
X0 = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))


def _dropout(x: torch.Tensor, p: float, gen: torch.Generator | None) -> torch.Tensor:
    """Inverted dropout drawing its mask from ``gen`` (default generator if None)."""
    keep = torch.empty_like(x).bernoulli_(1 - p, generator=gen)
    return x * keep / (1 - p)


def _block(x: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """Draws before, inside and after a save region (and inside a recompute one)."""
    x = _dropout((x @ W).tanh(), 0.5, gen)
    kept = remat.region(
        lambda t: _dropout((t @ W).sin(), 0.5, gen), "kept", recompute=False
    )
    y = kept(x)
    remat.recompute_needs_tensor(y)
    x = x + y
    again = remat.region(
        lambda t: _dropout((t @ W).tanh(), 0.3, gen), "again", recompute=True
    )
    x = again(x)
    return _dropout((x @ W).tanh(), 0.5, gen)


def _grads(run, seed_gen) -> list[torch.Tensor]:
    seed_gen()
    W.grad = None
    x = X0.clone().requires_grad_()
    run(x).pow(2).sum().backward()
    return [x.grad.clone(), W.grad.clone()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_generator_hook_makes_user_generator_dropout_replay_exactly():
    gen = torch.Generator()

    def reseed():
        gen.manual_seed(1234)

    ref = _grads(lambda x: _block(x, gen), reseed)
    with_hook = remat.checkpoint(
        region_name="blk", recompute_state_hooks=(GeneratorStateHook(gen),)
    )
    assert _same(ref, _grads(lambda x: with_hook(_block)(x, gen), reseed))
    # The generator ends where the plain run leaves it (replay is fork-like).
    reseed()
    _block(X0, gen)
    after_ref = gen.get_state()
    _grads(lambda x: with_hook(_block)(x, gen), reseed)
    assert torch.equal(gen.get_state(), after_ref)
    # Without the hook, replay draws other masks: the comparison can fail.
    without = remat.checkpoint(region_name="blk", recompute_state_hooks=())
    assert not _same(ref, _grads(lambda x: without(_block)(x, gen), reseed))


def test_default_hooks_make_default_generator_dropout_replay_exactly():
    def reseed():
        torch.manual_seed(4321)

    ref = _grads(lambda x: _block(x, None), reseed)
    ck = remat.checkpoint(
        region_name="blk", recompute_state_hooks=default_state_hooks("cpu")
    )
    assert _same(ref, _grads(lambda x: ck(_block)(x, None), reseed))
    none = remat.checkpoint(region_name="blk", recompute_state_hooks=())
    assert not _same(ref, _grads(lambda x: none(_block)(x, None), reseed))


class _Counting:
    def __init__(self) -> None:
        self.events: list[tuple[str, bool, int]] = []
        self.n = 0

    def snapshot(self) -> int:
        self.n += 1
        self.events.append(("snapshot", remat.is_recomputing(), self.n))
        return self.n

    def restore(self, state: int) -> None:
        self.events.append(("restore", remat.is_recomputing(), state))


def _two_save_regions(x: torch.Tensor) -> torch.Tensor:
    x = (x @ W).tanh()
    x = remat.region(lambda t: (t @ W).sin(), "s1", recompute=False)(x)
    remat.recompute_needs_tensor(x)
    x = (x @ W).tanh()
    x = remat.region(lambda t: (t @ W).sin(), "s2", recompute=False)(x)
    remat.recompute_needs_tensor(x)
    return (x @ W).tanh()


def test_snapshot_and_restore_points_with_two_save_regions():
    hook = _Counting()
    y = remat.checkpoint(region_name="blk", recompute_state_hooks=(hook,))(
        _two_save_regions
    )(X0.clone().requires_grad_())
    # Forward: at entry and after each save region.
    assert hook.events == [
        ("snapshot", False, 1),
        ("snapshot", False, 2),
        ("snapshot", False, 3),
    ]
    hook.events.clear()
    y.sum().backward()
    # Replay: keep the outside state (4), restore entry, after s1, after s2, then 4.
    assert hook.events == [
        ("snapshot", True, 4),
        ("restore", True, 1),
        ("restore", True, 2),
        ("restore", True, 3),
        ("restore", True, 4),
    ]


class _Broken:
    def __init__(self, where: str) -> None:
        self.where = where

    def snapshot(self) -> int:
        if self.where == "snapshot":
            raise ValueError("no state here")
        return 0

    def restore(self, state: int) -> None:
        if self.where == "restore":
            raise ValueError("cannot restore")


def test_hook_whose_snapshot_raises_names_the_checkpoint():
    ck = remat.checkpoint(
        region_name="layers.3", recompute_state_hooks=(_Broken("snapshot"),)
    )
    with pytest.raises(
        remat.RematError, match=r"_Broken\.snapshot\(\).*'layers\.3'"
    ) as info:
        ck(_two_save_regions)(X0.clone().requires_grad_())
    assert isinstance(info.value.__cause__, ValueError)


def test_hook_whose_restore_raises_names_the_checkpoint():
    ck = remat.checkpoint(
        region_name="layers.4", recompute_state_hooks=(_Broken("restore"),)
    )
    y = ck(_two_save_regions)(X0.clone().requires_grad_())
    with pytest.raises(remat.RematError, match=r"_Broken\.restore\(\).*'layers\.4'"):
        y.sum().backward()


def test_cpu_autocast_bf16_replays_through_checkpoint_with_save_region():
    seen: list[tuple[bool, bool, torch.dtype]] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        seen.append(
            (
                remat.is_recomputing(),
                torch.is_autocast_enabled("cpu"),
                torch.get_autocast_dtype("cpu"),
            )
        )
        h = (x @ W).relu()
        h = remat.region(lambda t: (t @ W).tanh(), "kept", recompute=False)(h)
        remat.recompute_needs_tensor(h)
        return (h @ W).float().sin()

    def grads(run) -> list[torch.Tensor]:
        W.grad = None
        x = X0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = run(x)
        y.pow(2).sum().backward()
        return [x.grad.clone(), W.grad.clone()]

    ref = grads(body)
    seen.clear()
    got = grads(remat.checkpoint(region_name="amp")(body))
    assert _same(ref, got)
    # The replay ran under the forward's autocast state, though backward is outside it.
    assert seen == [(False, True, torch.bfloat16), (True, True, torch.bfloat16)]


# --- CUDA (scripts/gpu_check.sh) ----------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_cuda_device_hook_is_philox_seed_and_offset():
    hook = DeviceRNGStateHook("cuda")
    assert hook.device == torch.device("cuda", torch.cuda.current_device())
    assert hook.generator is torch.cuda.default_generators[hook.device.index]
    state = hook.snapshot()
    assert isinstance(state, PhiloxState)
    assert hook.nbytes(state) == PHILOX_SNAPSHOT_NBYTES == 16
    assert state.offset == hook.generator.get_offset()
    _round_trip(hook, lambda: torch.rand(1000, device=hook.device))
    # The snapshot is exact: the full state after a restore matches.
    full = torch.cuda.get_rng_state(hook.device)
    hook.restore(hook.snapshot())
    assert torch.equal(torch.cuda.get_rng_state(hook.device), full)


@pytest.mark.gpu
@needs_cuda
def test_cuda_default_device_follows_local_rank_and_set_device(monkeypatch):
    count = torch.cuda.device_count()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert rank_device() == torch.device("cuda", 0)
    # A LOCAL_RANK beyond the visible devices (CUDA_VISIBLE_DEVICES=one per process)
    # falls back to the current device.
    monkeypatch.setenv("LOCAL_RANK", str(count))
    assert rank_device() == torch.device("cuda", torch.cuda.current_device())
    if count >= 2:
        monkeypatch.setenv("LOCAL_RANK", "1")
        assert DeviceRNGStateHook().device == torch.device("cuda", 1)
        prev = torch.cuda.current_device()
        try:
            torch.cuda.set_device(1)
            monkeypatch.setenv("LOCAL_RANK", "0")
            assert DeviceRNGStateHook().device == torch.device("cuda", 1)  # set wins
        finally:
            torch.cuda.set_device(prev)


@pytest.mark.gpu
@needs_cuda
def test_cuda_dropout_replays_exactly_with_default_hooks():
    dev = torch.device("cuda", torch.cuda.current_device())
    w = torch.nn.Parameter(torch.randn(64, 64, device=dev) / 8)
    x0 = torch.randn(32, 64, device=dev)

    def body(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.dropout((x @ w).tanh(), 0.5)
        kept = remat.region(
            lambda t: torch.nn.functional.dropout((t @ w).sin(), 0.5),
            "kept",
            recompute=False,
        )
        y = kept(x)
        remat.recompute_needs_tensor(y)
        return torch.nn.functional.dropout(((x + y) @ w).tanh(), 0.5)

    def grads(run) -> list[torch.Tensor]:
        torch.cuda.manual_seed(99)
        w.grad = None
        x = x0.clone().requires_grad_()
        run(x).pow(2).sum().backward()
        return [x.grad.clone(), w.grad.clone()]

    ref = grads(body)
    hooks = default_state_hooks()
    assert isinstance(hooks[0], DeviceRNGStateHook) and hooks[0].device == dev
    assert _same(
        ref, grads(remat.checkpoint(region_name="c", recompute_state_hooks=hooks)(body))
    )
    assert not _same(
        ref, grads(remat.checkpoint(region_name="c", recompute_state_hooks=())(body))
    )


@pytest.mark.gpu
@needs_cuda
def test_cuda_dtensor_dropout_replays_exactly(tmp_path):
    """One-rank CUDA mesh: DTensor's offset tracker exists and uses the device RNG."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor import _random as dt_random

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    backend = "nccl" if dist.is_nccl_available() else "gloo"
    dist.init_process_group(
        backend, store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    saved_tracker = dt_random._rng_tracker
    try:
        dt_random._rng_tracker = None
        mesh = init_device_mesh("cuda", (1,))
        dev = torch.device("cuda", torch.cuda.current_device())
        w = torch.nn.Parameter(
            distribute_tensor(torch.randn(16, 16, device=dev), mesh, [Shard(0)])
        )

        # Plain tensors cross the checkpoint boundary; DTensor random ops inside.
        def body(x: torch.Tensor) -> torch.Tensor:
            h = DTensor.from_local(x, mesh, [Shard(0)]) * w
            h = torch.nn.functional.dropout(h, 0.5)
            return torch.nn.functional.dropout(h.tanh(), 0.5).to_local()

        def grads(run) -> torch.Tensor:
            torch.manual_seed(7)
            w.grad = None
            run(torch.ones(16, 16, device=dev)).pow(2).sum().backward()
            return w.grad.to_local().clone()

        hook = DTensorRNGStateHook()  # on its own, without the device hook
        ck = remat.checkpoint(region_name="dt", recompute_state_hooks=(hook,))
        # The first DTensor random op creates the tracker inside the forward: the
        # replay warns (one rank, so the sync changed nothing and grads still match).
        with pytest.warns(RuntimeWarning, match="tracker was created inside"):
            first = grads(ck(body))
        ref = grads(body)
        assert torch.equal(ref, first)
        tracker = dt_random._rng_tracker
        assert isinstance(tracker, dt_random.OffsetBasedRNGTracker)
        state = hook.snapshot()
        assert state.had_tracker and state.distribute_region_enabled is True
        assert [d for d, _ in state.generators] == [dev]
        assert hook.nbytes(state) == PHILOX_SNAPSHOT_NBYTES
        assert torch.equal(ref, grads(ck(body)))
        hooks = default_state_hooks()
        assert torch.equal(
            ref,
            grads(
                remat.checkpoint(region_name="dt", recompute_state_hooks=hooks)(body)
            ),
        )
        bad = grads(remat.checkpoint(region_name="dt", recompute_state_hooks=())(body))
        assert not torch.equal(ref, bad)
    finally:
        dt_random._rng_tracker = saved_tracker
        dist.destroy_process_group()
