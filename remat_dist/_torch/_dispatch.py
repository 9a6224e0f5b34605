"""The dispatcher's private pieces: dispatch keys and keysets, the thread-local
included set, every registered op name, an op's boxed redispatch, and making
higher-order operators pass a key through."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "all_op_names",
    "hops_fall_through",
    "key_is_free",
    "keyset_full_after",
    "key_reached_in_torch_dispatch",
    "parse_dispatch_key",
    "redispatch_of",
    "tls_key_included",
    "tls_set_key_included",
]

parse_dispatch_key: Callable[[str], Any] = torch._C._parse_dispatch_key
"""The ``DispatchKey`` of a name (raises for an unknown one)."""
keyset_full_after: Callable[[Any], Any] = torch._C._dispatch_keyset_full_after
"""The keyset of every key below ``key``."""
tls_key_included: Callable[[Any], bool] = (
    torch._C._dispatch_tls_is_dispatch_key_included
)
"""Whether ``key`` is in this thread's included set."""
tls_set_key_included: Callable[[Any, bool], None] = (
    torch._C._dispatch_tls_set_dispatch_key_included
)
"""Put ``key`` into (True) or take it out of (False) this thread's included set."""
all_op_names: Callable[[], list[str]] = torch._C._dispatch_get_all_op_names
"""The qualified names (``ns::op``) of every registered op."""


def key_is_free(name: str) -> bool:
    """Whether dispatch key ``name`` exists and nothing is registered at it (no
    backend fallback, no kernel)."""
    try:
        key = torch._C._parse_dispatch_key(name)
    except Exception:
        return False
    return key is not None and (
        not torch._C._dispatch_has_backend_fallback(key)
        and not torch._C._dispatch_get_registrations_for_dispatch_key(name)
    )


def key_reached_in_torch_dispatch(name: str) -> bool:
    """Whether a kernel at dispatch key ``name`` is reached by an op called inside
    a ``__torch_dispatch__`` (DTensor's, a ``TorchDispatchMode``'s): the key sits
    below ``Python``, since the ``Python`` kernel excludes every key above it.

    ``Fake`` is below ``Python`` from torch 2.13; on 2.11 and 2.12 it is above, so
    a kernel there misses the collectives DTensor issues for the redistributions
    its ``__torch_dispatch__`` runs (the implicit all-gathers and reduce-scatters
    of tensor and sequence parallelism)."""
    try:
        key = torch._C._parse_dispatch_key(name)
    except Exception:
        return False
    python = torch._C._parse_dispatch_key("Python")
    return key is not None and torch._C._dispatch_keyset_full_after(python).has(key)


def redispatch_of(overload: Any) -> Callable[..., Any]:
    """``overload``'s boxed redispatch: ``redispatch(keyset, *args)`` runs the
    kernel of the highest key in ``keyset``."""
    return overload._handle.redispatch_boxed


def hops_fall_through(key: Any) -> None:
    """Let higher-order operators pass ``key`` like every ATen op does.

    HOPs dispatch in Python and ignore backend fallbacks: with the key included, a
    HOP that a compiled graph runs at runtime (``run_and_save_rng_state``, which
    AOTAutograd puts before a recomputed random op) would find no kernel for it.
    Existing HOPs get a fallthrough, later ones take it from torch's default list.
    """
    import torch._ops as ops

    defaults = getattr(ops, "_HIGHER_ORDER_OP_DEFAULT_FALLTHROUGH_DISPATCH_KEYS", None)
    if isinstance(defaults, list) and key not in defaults:
        defaults.append(key)
    for hop in list(getattr(ops, "_higher_order_ops", {}).values()):
        hop.fallthrough(key)
