"""``REMAT_DIST_AS_TORCH_REMAT=1``: ``import torch_remat`` gives remat_dist in every
process of a job, torchrun workers included, with no line of the job changed.

The package ships ``remat_dist_torch_remat.pth`` into site-packages. Python runs
its one line at the start of every interpreter, before any user code; the line
only reads the variable (nothing else happens while it is unset or ``0``) and,
when it is set, runs this file on its own (without importing remat_dist or torch,
so processes that never import torch_remat pay nothing): :func:`install_finder`
puts a finder first on ``sys.meta_path``. The first ``import torch_remat`` then
calls ``remat_dist.compat.install_torch_remat_alias(force=True)`` (a real
torch_remat, installed beside, is replaced in that process) and prints one line
on stderr naming the library that serves ``torch_remat``, its version, and the
rank. When that cannot happen (a value that is neither on nor off, remat_dist
failing to import) the import raises an error naming the variable and the fix,
rather than fall back to the real torch_remat.

Only the standard library at module level: the ``.pth`` line runs this file as a
standalone module. Nothing here runs on ``import remat_dist``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

VARIABLE = "REMAT_DIST_AS_TORCH_REMAT"
ALIAS = "torch_remat"
PTH_NAME = "remat_dist_torch_remat.pth"
"""The file the package installs into site-packages (setup.py ships it)."""
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def _value() -> str:
    return os.environ.get(VARIABLE, "").strip().lower()


class _TorchRematFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``import torch_remat`` (the top-level name only) with remat_dist."""

    remat_dist_torch_remat_finder = True
    """Marks this finder whichever copy of the module made it (the ``.pth`` runs
    the file under another module name than ``remat_dist._torch_remat_env``)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != ALIAS:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec: Any) -> Any:
        return serve()

    def exec_module(self, module: Any) -> None:
        return None  # remat_dist is imported already


def install_finder() -> bool:
    """What the ``.pth`` line calls: put the finder first on ``sys.meta_path`` when
    the variable asks for it (once). Returns whether it is installed."""
    if _value() in _OFF:
        return False
    if not any(
        getattr(f, "remat_dist_torch_remat_finder", False) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _TorchRematFinder())
    return True


def serve() -> Any:
    """Serve ``torch_remat`` from remat_dist now, or refuse naming the variable."""
    raw = os.environ.get(VARIABLE, "")
    if _value() not in _ON:
        raise _refusal(
            raw,
            f"{raw!r} is neither on ({', '.join(_ON)}) nor off ("
            f"{', '.join(repr(v) for v in _OFF)})",
            f"set {VARIABLE}=1 to serve torch_remat from remat_dist, or "
            f"{VARIABLE}=0 (or unset it) for the installed torch_remat",
        )
    try:
        import remat_dist.compat as compat
    except Exception as exc:
        raise _refusal(
            raw,
            f"importing remat_dist failed ({type(exc).__name__}: {exc})",
            f"repair the remat_dist install in this environment (python -c 'import "
            f"remat_dist' shows the error), or unset {VARIABLE} to use the installed "
            "torch_remat",
        ) from exc
    module = compat.install_torch_remat_alias(force=True)
    # One write of the whole line: ranks under torchrun share one stderr pipe, and
    # print() writes the text and its newline apart, so two ranks' lines could merge.
    sys.stderr.write(announcement(module) + "\n")
    sys.stderr.flush()
    return module


class TorchRematAliasError(RuntimeError):
    """``REMAT_DIST_AS_TORCH_REMAT`` is set but remat_dist cannot serve torch_remat.

    A ``RuntimeError``, not an ``ImportError``: code that falls back when
    ``import torch_remat`` raises ``ImportError`` would silently run the real one.
    """


def _refusal(raw: str, why: str, fix: str) -> TorchRematAliasError:
    return TorchRematAliasError(
        f"remat_dist{_rank()}: {VARIABLE}={raw!r} asks remat_dist to serve 'import "
        f"torch_remat', but {why}; refusing rather than run the real torch_remat "
        f"silently. Fix: {fix}."
    )


def _rank() -> str:
    rank = os.environ.get("RANK")
    return f" [rank {rank}]" if rank is not None else ""


def _version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def announcement(module: Any) -> str:
    """The line each process prints when remat_dist starts serving torch_remat."""
    where = os.path.dirname(getattr(module, "__file__", "") or "")
    line = (
        f"remat_dist{_rank()}: torch_remat is served by remat_dist "
        f"{getattr(module, '__version__', '?')} ({where}), because "
        f"{VARIABLE}={os.environ.get(VARIABLE, '')}"
    )
    real = _version("torch_remat") or _version("torch-remat")
    if real is not None:
        line += f"; the installed torch_remat {real} is not used in this process"
    return line


if __name__ == "remat_dist_torch_remat_env":  # run by the .pth line
    install_finder()
