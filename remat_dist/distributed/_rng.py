"""Per-rank RNG state hooks: random ops replay bit-identically on every rank.

A checkpoint snapshots its state hooks at entry and after every save region, and
restores those snapshots at the same points on replay (and restores, at replay
end, the state that replay found, so backward and the next step see undisturbed
generators). With the hooks here, dropout inside a checkpoint draws the same masks
on replay as on forward, on each rank, whatever that rank's generator holds:

* :class:`DeviceRNGStateHook`: this rank's accelerator generator (CUDA, XPU, ...,
  reached through ``torch.get_device_module``); the CPU generator on a CPU run.
* :class:`CPURNGStateHook`: the CPU generator, opt-in on an accelerator run.
* :class:`GeneratorStateHook`: any other ``torch.Generator`` (Megatron-style named
  streams: one hook per generator).
* :class:`DTensorRNGStateHook`: what DTensor's random ops draw from.

Which device a hook resolves to is ``remat_dist.distributed._rank_device``'s
:func:`rank_device`; which hooks a checkpoint gets by default is
``remat_dist.distributed._rng_default``'s ``default_state_hooks``.

What one snapshot costs (payload bytes; :meth:`GeneratorStateHook.nbytes` reports
it): a Philox generator (CUDA; any accelerator where seed plus offset is checked to
be its whole state) is two Python ints, 16 bytes, and no tensor; an MT19937 CPU
generator is a 5056-byte ``uint8`` tensor; other accelerators' full state tensor as
their backend defines it.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from remat_dist._torch._dtensor import dtensor_rng_tracker
from remat_dist.distributed._rank_device import (
    accelerator_type,
    current_index,
    rank_device,
)
from remat_dist.distributed._ready import dist_ready

__all__ = [
    "PHILOX_SNAPSHOT_NBYTES",
    "CPURNGStateHook",
    "DTensorRNGState",
    "DTensorRNGStateHook",
    "DeviceRNGStateHook",
    "GeneratorStateHook",
    "PhiloxState",
]


PHILOX_SNAPSHOT_NBYTES = 16
"""Payload of a Philox snapshot: a 64-bit seed and a 64-bit offset."""


class PhiloxState(NamedTuple):
    """A Philox generator's whole state: ``initial_seed()`` and ``get_offset()``."""

    seed: int
    offset: int


# Per generator: may it be snapshotted as (seed, offset)? Probed once.
_philox_exact: weakref.WeakKeyDictionary[torch.Generator, bool] = (
    weakref.WeakKeyDictionary()
)
# The same for generators that take no weak reference (torch 2.11, 2.12): by id,
# holding the generator so that its id is not reused.
_philox_exact_by_id: dict[int, tuple[torch.Generator, bool]] = {}


def _is_philox(gen: torch.Generator) -> bool:
    """Whether ``(initial_seed(), get_offset())`` is ``gen``'s whole state.

    Probed, not assumed: the pair is written back with ``manual_seed`` +
    ``set_offset`` and the result compared with ``get_state()``. The CPU generator
    (MT19937, which also caches normal samples) has no offset and never qualifies.
    """
    if gen.device.type == "cpu":
        return False
    try:
        known = _philox_exact.get(gen)
    except TypeError:
        known = _philox_exact_by_id.get(id(gen), (None, None))[1]
    if known is not None:
        return known
    full = gen.get_state()
    try:
        seed, offset = gen.initial_seed(), gen.get_offset()
        gen.manual_seed(seed)
        gen.set_offset(offset)
        exact = torch.equal(gen.get_state(), full)
    except (RuntimeError, NotImplementedError):
        exact = False
    if not exact:
        gen.set_state(full)
    try:
        _philox_exact[gen] = exact
    except TypeError:
        _philox_exact_by_id[id(gen)] = (gen, exact)
    return exact


def _state_nbytes(state: Any) -> int:
    if isinstance(state, PhiloxState):
        return PHILOX_SNAPSHOT_NBYTES
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    raise TypeError(f"not a generator snapshot: {type(state).__name__}")


class GeneratorStateHook:
    """Keep one ``torch.Generator`` aligned across replay.

    Use it for any generator that random ops inside a checkpoint take through
    ``generator=``: a Megatron-style named stream is one hook per generator.

    Args:
        generator: the ``torch.Generator`` the random ops draw from.

    Example::

        # a tensor-parallel stream seeded per rank, next to the default one

        tp_gen = torch.Generator(device).manual_seed(base_seed + 2718 + tp_rank)
        hooks = (*remat_dist.distributed.default_state_hooks(),
                 GeneratorStateHook(tp_gen))
        remat_dist.checkpoint(region_name="layers.0", recompute_state_hooks=hooks)(blk)

    One snapshot costs 16 bytes (two ints, no tensor) for a Philox generator (CUDA)
    and a 5056-byte ``uint8`` tensor for a CPU (MT19937) generator;
    :meth:`nbytes` tells. The hook holds the generator itself (not a copy): it
    restores the very object the random ops use.
    """

    def __init__(self, generator: torch.Generator) -> None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(
                f"GeneratorStateHook(generator): expected a torch.Generator, got "
                f"{type(generator).__name__}"
            )
        self.generator = generator
        self._philox: bool | None = None
        if generator.device.type == "cpu" and _plain_calls(type(self)):
            # MT19937: the snapshot is the generator's state tensor, taken and put
            # back by the generator's own methods (no Python frame of ours, at
            # every checkpoint entry and replay)
            self._philox = False
            self.snapshot = generator.get_state  # type: ignore[method-assign]
            self.restore = generator.set_state  # type: ignore[method-assign]

    @property
    def device(self) -> torch.device:
        """The device whose random ops this generator serves."""
        return self.generator.device

    def snapshot(self) -> PhiloxState | torch.Tensor:
        """The generator's state: ``PhiloxState`` (16 bytes) or a state tensor."""
        gen = self.generator
        philox = self._philox
        if philox is None:  # probed once per hook (it runs twice per checkpoint)
            philox = self._philox = _is_philox(gen)
        if philox:
            return PhiloxState(gen.initial_seed(), gen.get_offset())
        return gen.get_state()

    def restore(self, state: PhiloxState | torch.Tensor) -> None:
        """Put the generator back into ``state`` (a value :meth:`snapshot` gave)."""
        gen = self.generator
        if isinstance(state, PhiloxState):
            gen.manual_seed(state.seed)
            gen.set_offset(state.offset)
        else:
            gen.set_state(state)

    def nbytes(self, state: PhiloxState | torch.Tensor) -> int:
        """Payload bytes of one snapshot (16 for Philox, 5056 for CPU MT19937)."""
        return _state_nbytes(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={str(self.device)!r})"


class CPURNGStateHook(GeneratorStateHook):
    """The CPU default generator (``torch.default_generator``).

    Opt-in on accelerator runs, where random ops inside a model rarely run on CPU:
    each snapshot copies the whole MT19937 state, a 5056-byte ``uint8`` tensor (at
    entry and after every save region of every checkpoint). On a CPU-only run
    :class:`DeviceRNGStateHook` already is this generator.

    Example::

        hooks = (*remat_dist.distributed.default_state_hooks(), CPURNGStateHook())
        remat_dist.checkpoint(region_name="layers.0", recompute_state_hooks=hooks)(blk)
    """

    def __init__(self) -> None:
        super().__init__(torch.default_generator)

    def __repr__(self) -> str:
        return "CPURNGStateHook()"



def _default_generator(device: torch.device) -> torch.Generator | None:
    """The default generator of ``device``, or None where the backend hides it."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    init = getattr(module, "init", None)
    if callable(init):
        init()  # torch.cuda / torch.xpu fill default_generators lazily
    gens = getattr(module, "default_generators", None)
    if gens:
        return gens[device.index or 0]
    getter = getattr(module, f"_get_default_{device.type}_generator", None)
    return getter() if callable(getter) else None


class DeviceRNGStateHook(GeneratorStateHook):
    """This rank's accelerator generator; the CPU generator on a CPU-only run.

    ``device=None`` resolves with :func:`rank_device` (the rank's current device,
    ``LOCAL_RANK`` when no device was set, never device 0 by accident). The
    generator is found through ``torch.get_device_module(device.type)``, so CUDA,
    ROCm, XPU and other accelerators share one path; where a backend exposes no
    generator object, its module's ``get_rng_state`` / ``set_rng_state`` are used.

    One snapshot costs 16 bytes on CUDA (Philox seed and offset, two Python ints,
    no tensor, no device sync) and 5056 bytes on CPU (the MT19937 state tensor).
    Resolving an accelerator device initialises its runtime, as
    ``torch.cuda.get_rng_state`` would; a run that keeps everything on CPU on a
    machine with an accelerator should pass ``device="cpu"``.

    Args:
        device: the rank's device (default: :func:`rank_device`'s choice).

    Example::

        hook = DeviceRNGStateHook()  # cuda:LOCAL_RANK under torchrun, else CPU
        remat_dist.checkpoint(region_name="layers.0", recompute_state_hooks=(hook,))(blk)
    """

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        dev = rank_device(device)
        gen = _default_generator(dev)
        self._device = dev
        if gen is None:
            # No generator object (a backend that only has module functions).
            self.generator = None  # type: ignore[assignment]
            self._module: Any = torch.get_device_module(dev.type)
        else:
            super().__init__(gen)
            self._module = None

    @property
    def device(self) -> torch.device:
        """The resolved device (with its index; ``cpu`` on a CPU run)."""
        return self._device

    def snapshot(self) -> PhiloxState | torch.Tensor:
        if self._module is not None:
            return self._module.get_rng_state(self._device)
        return super().snapshot()

    def restore(self, state: PhiloxState | torch.Tensor) -> None:
        if self._module is not None:
            self._module.set_rng_state(state, self._device)
        else:
            super().restore(state)

    def __repr__(self) -> str:
        return f"DeviceRNGStateHook(device={str(self._device)!r})"


def _plain_calls(cls: type) -> bool:
    """Whether ``cls`` snapshots and restores as :class:`GeneratorStateHook` does
    (a subclass overriding either keeps its own)."""
    return cls.snapshot in _PLAIN_SNAPSHOTS and cls.restore in _PLAIN_RESTORES


_PLAIN_SNAPSHOTS = (GeneratorStateHook.snapshot, DeviceRNGStateHook.snapshot)
_PLAIN_RESTORES = (GeneratorStateHook.restore, DeviceRNGStateHook.restore)


class DTensorRNGState(NamedTuple):
    """A :class:`DTensorRNGStateHook` snapshot.

    Attributes:
        had_tracker: whether DTensor's RNG tracker existed.
        distribute_region_enabled: the tracker's flag, None without a tracker.
        generators: ``(device, generator snapshot)`` per covered generator.
    """

    had_tracker: bool
    distribute_region_enabled: bool | None
    generators: tuple[tuple[torch.device, Any], ...]


_dtensor_tracker = dtensor_rng_tracker


class DTensorRNGStateHook:
    """Keep what DTensor's random ops draw from aligned across replay, per rank.

    What torch 2.13 keeps (read from ``torch.distributed.tensor._random``):

    * DTensor's ``OffsetBasedRNGTracker`` keeps **no generator state of its own**.
      A random op on a sharded DTensor reads the device's default generator, moves
      its offset to this shard's slice of the global stream, draws, and leaves the
      generator at ``old offset + global numel`` on every rank. The tracker's own
      state is only its ``distribute_region_enabled`` flag (and its existence: it
      is created on the first DTensor random op, broadcasting rank 0's generator
      state to every rank).
    * On CUDA the generator is the *current* device's (eager ops go through
      ``run_dtensor_rng_op``, which uses ``torch.cuda.get_rng_state()``), or the
      tracker's device ``cuda:(rank % device_count)`` (ops on tensor subclasses,
      other accelerators). This hook covers both (one snapshot when they coincide),
      16 bytes each, plus the flag. An op given ``generator=`` draws from that
      generator (the tracker moves its offset): give it a
      :class:`GeneratorStateHook`.
    * On CPU there is no tracker at all (DTensor declines CPU meshes: ``torch.cpu``
      has no ``set_rng_state``), and each rank's shard draws from the plain per-rank
      CPU generator, so equal seeds give every shard the same local mask. This hook
      then snapshots the CPU generator (5056 bytes), which makes it exact on its
      own; :func:`default_state_hooks` leaves it out there, since the device hook
      already is that generator.

    Args:
        device_type: the device type of the mesh the DTensors live on. Default: the
            accelerator when one is available, else ``"cpu"``. Pass ``"cpu"`` for a
            CPU mesh on a machine that has an accelerator.
        exclude_devices: devices whose default generator another hook in the same
            set already covers (``default_state_hooks`` passes its device hook's),
            so a snapshot does not copy it twice.

    Restoring an entry snapshot taken before the tracker existed, once it exists,
    warns: that tracker was created inside the forward and synchronised the
    generators there, which replay cannot repeat. Seed every rank alike with
    ``torch.manual_seed`` (then the sync changes nothing), or run one DTensor random
    op before the first checkpoint.

    Example::

        hooks = (DeviceRNGStateHook(), DTensorRNGStateHook())
        remat_dist.checkpoint(region_name="layers.0", recompute_state_hooks=hooks)(blk)
    """

    def __init__(
        self,
        *,
        device_type: str | None = None,
        exclude_devices: Sequence[torch.device | str] = (),
    ) -> None:
        if device_type is not None:
            device_type = torch.device(device_type).type
        self.device_type = device_type
        self.exclude_devices = frozenset(rank_device(d) for d in exclude_devices)
        self._hooks: dict[torch.device, DeviceRNGStateHook] = {}

    def _devices(self, tracker: Any) -> list[torch.device]:
        acc = self.device_type or accelerator_type() or "cpu"
        if acc == "cpu":
            devices = [torch.device("cpu")]
        else:
            devices = [torch.device(acc, current_index(acc))]
            tracker_dev = getattr(tracker, "_device", None)
            if isinstance(tracker_dev, torch.device) and tracker_dev.type != "cpu":
                devices.append(rank_device(tracker_dev))
            elif tracker is None:
                devices.append(_would_be_tracker_device(acc))
        out: list[torch.device] = []
        for d in devices:
            if d not in out and d not in self.exclude_devices:
                out.append(d)
        return out

    def _hook(self, device: torch.device) -> DeviceRNGStateHook:
        hook = self._hooks.get(device)
        if hook is None:
            hook = self._hooks[device] = DeviceRNGStateHook(device)
        return hook

    def snapshot(self) -> DTensorRNGState:
        """The tracker's flag and the state of every generator DTensor may use."""
        tracker = _dtensor_tracker()
        enabled = None if tracker is None else bool(tracker.distribute_region_enabled)
        gens = tuple((d, self._hook(d).snapshot()) for d in self._devices(tracker))
        return DTensorRNGState(tracker is not None, enabled, gens)

    def restore(self, state: DTensorRNGState) -> None:
        """Put the generators and the tracker's flag back into ``state``."""
        for device, s in state.generators:
            self._hook(device).restore(s)
        tracker = _dtensor_tracker()
        if tracker is None:
            return
        if state.distribute_region_enabled is not None:
            tracker.distribute_region_enabled = state.distribute_region_enabled
        elif not state.had_tracker:
            warnings.warn(
                "remat_dist: DTensor's RNG tracker was created inside a checkpoint's "
                "forward (by the first DTensor random op), which synchronised the "
                "generators of all ranks there; replay cannot repeat that. Seed every "
                "rank with the same torch.manual_seed, or run one DTensor random op "
                "before the first checkpoint.",
                RuntimeWarning,
                stacklevel=2,
            )

    def nbytes(self, state: DTensorRNGState) -> int:
        """Payload bytes of one snapshot (the flag not counted)."""
        return sum(_state_nbytes(s) for _, s in state.generators)

    def __repr__(self) -> str:
        skip = sorted(str(d) for d in self.exclude_devices)
        return (
            f"DTensorRNGStateHook(device_type={self.device_type!r}, "
            f"exclude_devices={skip})"
        )


def _would_be_tracker_device(acc: str) -> torch.device:
    """The device DTensor's tracker will pick once created: ``rank % device_count``."""
    if not dist_ready():
        return torch.device(acc, current_index(acc))
    import torch.distributed as dist

    module = torch.get_device_module(acc)
    count_fn = getattr(module, "device_count", None)
    count = max(1, count_fn() if callable(count_fn) else 1)
    return torch.device(acc, dist.get_rank() % count)

