"""Small text helpers shared by every report: byte sizes, rank and name ranges.

Kept free of torch so that the cross-rank aggregation (a pure function of per-rank
summaries) and its tests need nothing else.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

__all__ = [
    "compress_ints",
    "compress_names",
    "format_bytes",
    "plural",
    "table",
]

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """``512 B``, ``1.5 KiB``, ``1.2 MiB``: binary units, one decimal above 1 KiB."""
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B" if n == int(n) else f"{n:.1f} B"
    for unit in _UNITS:
        n /= 1024.0
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def plural(n: int, word: str) -> str:
    """``1 storage`` / ``2 storages``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def compress_ints(values: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``0-3,5`` (sorted, duplicates dropped)."""
    nums = sorted(set(values))
    parts: list[str] = []
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        parts.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(parts)


_TRAILING_INT = re.compile(r"^(.*?)(\d+)$")


def compress_names(names: Sequence[str]) -> str:
    """``layers.0 .. layers.3`` -> ``layers.0-3``; other names are listed.

    Names that end in an integer are grouped by what precedes it, and the integers
    compressed into ranges (``layers.0-3,5``). Groups keep the order in which their
    first name appears; names without a trailing integer are listed as they are.
    """
    groups: dict[str, list[int]] = {}
    order: list[tuple[str, str | None]] = []
    for name in names:
        m = _TRAILING_INT.match(name)
        if m is None or (len(m.group(2)) > 1 and m.group(2).startswith("0")):
            order.append((name, None))
            continue
        prefix = m.group(1)
        if prefix not in groups:
            groups[prefix] = []
            order.append((prefix, prefix))
        groups[prefix].append(int(m.group(2)))
    out: list[str] = []
    for text, prefix in order:
        if prefix is None:
            out.append(text)
        else:
            out.append(prefix + compress_ints(groups[prefix]))
    return ", ".join(out)


def table(
    rows: Sequence[Sequence[str]],
    *,
    indent: str = "",
    right: Iterable[int] = (),
    cap: int = 40,
) -> list[str]:
    """Align ``rows`` into columns separated by two spaces.

    Columns listed in ``right`` are right-aligned (numbers); the last column is
    never padded, so lines carry no trailing blanks. A cell longer than ``cap``
    does not widen its column (it pushes its own line to the right instead), so
    one long rank list does not push every other line far right.
    """
    if not rows:
        return []
    right_cols = set(right)
    ncols = max(len(r) for r in rows)
    widths = [0] * ncols
    for r in rows:
        for i, cell in enumerate(r):
            if len(cell) <= cap:
                widths[i] = max(widths[i], len(cell))
    lines = []
    for r in rows:
        cells = []
        for i, cell in enumerate(r):
            last = i == len(r) - 1
            if i in right_cols:
                cells.append(cell.rjust(widths[i]))
            elif last:
                cells.append(cell)
            else:
                cells.append(cell.ljust(widths[i]))
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines
