"""remat_dist's loggers: ``logging.getLogger("remat_dist")`` and its children.

Quiet by default: no handler is added, so until the application configures
``logging``, Python's last-resort handler prints warnings and errors to stderr and
drops the rest (a ``NullHandler`` would drop the warnings too, such as a memory
budget exceeded). ``REMAT_DIST_LOG=info`` or ``=debug`` in the environment adds
a stderr handler at that level; configuring the ``remat_dist`` logger with the
standard ``logging`` API works as for any library. Every message carries this
process's rank (``[rank 3] ...``) once a process group exists, so the lines of a
torchrun job can be told apart.

At info: one line per agreement among the ranks at stake (with its cost), every
timeout and divergence. At debug: each replay's collectives.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

__all__ = ["get_logger"]

ROOT = "remat_dist"
ENV = "REMAT_DIST_LOG"


class _RankPrefix(logging.LoggerAdapter):
    """Prefixes each message with ``[rank r]`` when a process group exists."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            return f"[rank {dist.get_rank()}] {msg}", kwargs
        return msg, kwargs


def get_logger(name: str) -> logging.LoggerAdapter:
    """The logger for module ``name`` (a child of ``remat_dist``), rank-prefixed."""
    return _RankPrefix(logging.getLogger(name), {})


def _configure() -> None:
    root = logging.getLogger(ROOT)
    level = os.environ.get(ENV, "").strip().upper()
    if not level:
        return
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        print(
            f"remat_dist: {ENV}={os.environ[ENV]!r} is not one of debug, info, "
            "warning, error; logging stays quiet.",
            file=sys.stderr,
        )
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)


_configure()
