"""Run code written as ``import torch_remat as remat`` on remat_dist, on request.

remat_dist keeps torch_remat 0.2.x's call shapes (``checkpoint(region_name=...)``,
``region``, ``recompute_needs_tensor``, ``collect_trace``, ...), so a codebase such
as torchtitan's torch_remat integration can run on it without edits once the name
``torch_remat`` resolves to remat_dist. :func:`install_torch_remat_alias` does that
in ``sys.modules``. Nothing here runs on import: importing remat_dist (or this
module) never touches ``torch_remat``, and a real torch_remat that can be imported
is never shadowed unless the caller says ``force=True``.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import remat_dist
from remat_dist._errors import RematError

__all__ = ["install_torch_remat_alias", "uninstall_torch_remat_alias"]

ALIAS = "torch_remat"

_replaced: list[ModuleType] = []
"""The torch_remat module ``force=True`` replaced (put back on uninstall)."""


def install_torch_remat_alias(*, force: bool = False) -> ModuleType:
    """Make ``import torch_remat`` give remat_dist, for this process.

    Call it before the code that imports torch_remat (the training script's first
    lines)::

        import remat_dist.compat

        remat_dist.compat.install_torch_remat_alias()
        import torch_remat as remat  # remat_dist

    Only the top-level name is aliased: ``import torch_remat._api`` and other private
    submodules stay unresolved. Calling it again is a no-op.

    Args:
        force: replace a real torch_remat too (one already imported, or one that
            could be imported). Without it such a torch_remat raises instead, since
            silently swapping an installed library is worse than the error.

    Returns:
        The ``remat_dist`` module, now also ``sys.modules["torch_remat"]``.

    Raises:
        RematError: a real torch_remat is imported or importable and ``force`` is
            false; the message names where it lives and the fixes.
    """
    current = sys.modules.get(ALIAS)
    if current is remat_dist:
        return remat_dist
    if not force:
        where = _real_torch_remat(current)
        if where is not None:
            raise RematError(
                f"remat_dist.compat.install_torch_remat_alias(): a real torch_remat is "
                f"{where}; aliasing would hide it from every later 'import "
                "torch_remat'. Fix: uninstall it (pip uninstall torch-remat) or "
                "import remat_dist directly (import remat_dist as remat), or pass "
                "force=True to replace it in this process on purpose."
            )
    if current is not None:
        _replaced[:] = [current]
    sys.modules[ALIAS] = remat_dist
    return remat_dist


def uninstall_torch_remat_alias() -> None:
    """Undo :func:`install_torch_remat_alias`: drop ``sys.modules["torch_remat"]``
    if it is remat_dist, and put back the torch_remat module that
    ``force=True`` replaced, if any (a real torch_remat there is left alone)."""
    if sys.modules.get(ALIAS) is remat_dist:
        del sys.modules[ALIAS]
        if _replaced:
            sys.modules[ALIAS] = _replaced.pop()


def _real_torch_remat(current: ModuleType | None) -> str | None:
    """Where a torch_remat that is not remat_dist lives, or None when there is none."""
    if current is not None:
        return f"already imported (from {getattr(current, '__file__', None)!r})"
    try:
        spec = importlib.util.find_spec(ALIAS)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return f"installed (at {spec.origin!r})"
