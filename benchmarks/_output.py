"""Where a benchmark's results go besides its table: ``--json PATH``."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["write_json"]


def write_json(result: Any, path: str | None) -> None:
    """Write ``result`` to ``path`` as indented JSON and say so (nothing without a
    path)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")
