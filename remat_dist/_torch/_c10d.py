"""c10d's private pieces: a work completed from a future (a served collective),
the default process group's store, and whether it exists (asked on every
checkpoint: one attribute read instead of ``is_initialized``'s three calls)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "default_group",
    "default_group_initialized",
    "default_store",
    "functional_wait",
    "work_from_future",
]


def default_group_initialized() -> bool:
    """``torch.distributed.is_initialized()`` without importing
    ``torch.distributed`` when nothing else has."""
    return default_group() is not None


def default_group() -> Any:
    """The default process group (``dist.group.WORLD``), None before it exists."""
    c10d = _C10D.module
    if c10d is None:
        c10d = _C10D.module = sys.modules.get("torch.distributed.distributed_c10d")
        if c10d is None:
            return None
    return c10d._world._default_pg


class _C10D:
    module: Any = None
    """c10d's module once imported (asked three times per checkpoint call: one
    attribute read instead of a lookup in ``sys.modules``)."""


def work_from_future(future: Any) -> Any:
    """A c10d ``Work`` that is done when ``future`` is (its result the future's)."""
    from torch._C._distributed_c10d import _create_work_from_future

    return _create_work_from_future(future)


def functional_wait() -> tuple[Callable[[], int] | None, Any]:
    """``(inflight, wait_tensor)``: how many outputs of functional collectives
    nobody has waited for yet (None where torch does not tell), and the op that
    waits for one; ``(None, None)`` without ``torch.distributed``."""
    import torch

    if not torch.distributed.is_available():
        return None, None
    from torch._C import _distributed_c10d

    size = getattr(_distributed_c10d, "_get_work_registry_size", None)
    return size, torch.ops._c10d_functional.wait_tensor


def default_store() -> Any:
    """The store of the default process group."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()
