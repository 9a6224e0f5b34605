"""Which device this rank's random ops use: :func:`rank_device` and its helpers.

The RNG hooks (``remat_dist.distributed._rng``) snapshot one device's generator; a
rank that resolved the wrong device (device 0 on every rank of a node, say) would
snapshot a generator its ops never touch and replay different dropout masks with
no error. The choice lives here, apart from the hooks, because other rank-aware
code needs the same answer (``all_gather_objects`` stages its tensors there).
"""

from __future__ import annotations

import os

import torch

__all__ = ["accelerator_type", "current_index", "rank_device"]


def accelerator_type() -> str | None:
    """The current accelerator's device type (``"cuda"``, ...), None without one."""
    if not torch.accelerator.is_available():
        return None
    acc = torch.accelerator.current_accelerator()
    return None if acc is None else acc.type


def _local_rank() -> int | None:
    raw = os.environ.get("LOCAL_RANK")
    try:
        return None if raw is None else int(raw)
    except ValueError:
        return None


def rank_device(device: torch.device | str | int | None = None) -> torch.device:
    """The device whose generator this rank's random ops use, with an index.

    ``None`` picks this rank's current device: the CPU when no accelerator is
    available; else the accelerator module's ``current_device()`` when a process set
    one (not 0), else ``LOCAL_RANK`` when it names a visible device (torchrun's one
    process per device, when the script builds tensors on ``cuda:LOCAL_RANK``
    without ``set_device``), else the current device. So a rank never lands on
    device 0 by accident. An int means that index of the current accelerator; a
    type without an index (``"cuda"``) takes the current index.
    """
    if isinstance(device, int):
        acc = accelerator_type()
        if acc is None:
            raise ValueError(
                f"rank_device({device}): an index needs an accelerator, and none is "
                "available. Pass 'cpu' or None."
            )
        return torch.device(acc, device)
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cpu" or dev.index is not None:
            return dev
        return torch.device(dev.type, current_index(dev.type))
    acc = accelerator_type()
    if acc is None:
        return torch.device("cpu")
    module = torch.get_device_module(acc)
    current = current_index(acc)
    local = _local_rank()
    count_fn = getattr(module, "device_count", None)
    count = count_fn() if callable(count_fn) else 1
    if current == 0 and local is not None and 0 <= local < count:
        return torch.device(acc, local)
    return torch.device(acc, current)


def current_index(device_type: str) -> int:
    """The accelerator module's ``current_device()`` (0 where it has none)."""
    module = torch.get_device_module(device_type)
    current = getattr(module, "current_device", None)
    return int(current()) if callable(current) else 0
