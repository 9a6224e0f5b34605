"""Recognising FSDP2's own collectives through FSDP2 itself.

FSDP2 (``fully_shard``) issues every collective of its own from two methods of its
parameter group: ``FSDPParamGroup.unshard`` (the all-gather, from its pre-forward
and pre-backward hooks, its prefetches and ``FSDPModule.unshard``) and
``FSDPParamGroup.post_backward`` (the reduce-scatter and HSDP's all-reduce, from its
post-backward hook and the end-of-backward callback). :func:`track_fsdp_collectives`
wraps both, once per process, so that a per-thread depth counts while one runs:
a collective issued while :func:`inside_fsdp` is true is FSDP2's. FSDP2 calls
both through the instance (``self.unshard()``, ``param_group.post_backward()``), so
the wrap also reaches modules sharded before it was installed.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["FSDP_METHODS", "inside_fsdp", "reset", "track_fsdp_collectives"]

FSDP_METHODS = ("unshard", "post_backward")
"""The ``FSDPParamGroup`` methods FSDP2 issues its collectives from."""

_WRAPPED = "__remat_dist_fsdp_wrapped__"


class _Depth(threading.local):
    """How many of FSDP2's collective-issuing methods run on this thread now."""

    def __init__(self) -> None:
        self.value = 0


class FSDPTracking:
    """This process's state of the tracking: whether the methods are wrapped, and
    the per-thread depth."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.installed = False
        self.depth = _Depth()

    def reset(self) -> None:
        """Zero this thread's depth (the wrap stays: it changes nothing else)."""
        self.depth.value = 0


STATE = FSDPTracking()


def reset() -> None:
    STATE.reset()


def inside_fsdp() -> bool:
    """Whether FSDP2's ``unshard`` or ``post_backward`` runs on this thread (a
    collective issued now is FSDP2's own)."""
    return STATE.depth.value > 0


def _wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    depth = STATE.depth

    @functools.wraps(fn)
    def issuing(*args: Any, **kwargs: Any) -> Any:
        depth.value += 1
        try:
            return fn(*args, **kwargs)
        finally:
            depth.value -= 1

    setattr(issuing, _WRAPPED, fn)
    return issuing


def track_fsdp_collectives() -> bool:
    """Wrap FSDP2's collective-issuing methods (once; idempotent). False where
    FSDP2 is not available (no ``torch.distributed``)."""
    if STATE.installed:
        return True
    with STATE.lock:
        if STATE.installed:
            return True
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_param_group import (
                FSDPParamGroup,
            )
        except ImportError:  # pragma: no cover - no torch.distributed
            return False
        for name in FSDP_METHODS:
            fn = FSDPParamGroup.__dict__[name]
            if getattr(fn, _WRAPPED, None) is None:
                setattr(FSDPParamGroup, name, _wrap(fn))
        STATE.installed = True
        return True
