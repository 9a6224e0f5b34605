"""What the harness reports about a call: the ranks' output, stacks and errors.

Everything here reads what the rank processes left behind (their stdout/stderr
files, faulthandler stack dumps, the failures they sent back) and turns it into
what the caller sees: output forwarded line by line with its rank, a pytest
skip/xfail when every rank asked for one, or a :class:`DistributedTestError` /
:class:`DistributedTimeoutError` naming the failed or stuck ranks with their remote
tracebacks and stacks. It holds no process state: the pool passes in its paths and
process ids.
"""

from __future__ import annotations

import os
import sys
import time

from remat_dist.testing import _worker
from remat_dist.testing._errors import (
    DistributedTestError,
    DistributedTimeoutError,
    RankFailure,
)

__all__ = [
    "FAILURE_GRACE_S",
    "common_outcome",
    "dump_stacks",
    "forward_output",
    "make_error",
    "read_from",
    "tail",
]

FAILURE_GRACE_S = 1.0
"""After the first rank fails, how long to wait for the others before giving up on
them (they are usually blocked in a collective that the failed rank never joins)."""

_OUTCOME_PASSTHROUGH = {
    "_pytest.outcomes.Skipped": "skip",
    "_pytest.outcomes.XFailed": "xfail",
}
"""Exceptions that, raised on every rank, are re-raised as they are (pytest.skip)."""


def tail(text: str, limit: int = 6000) -> str:
    """The last ``limit`` characters of ``text``, marked as cut when longer."""
    if len(text) <= limit:
        return text
    return "...(cut)...\n" + text[-limit:]


def read_from(path: str, offset: int) -> tuple[str, int]:
    """What ``path`` holds after byte ``offset``, and the offset of its end (a
    missing file reads as empty)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return "", offset
    return data.decode("utf-8", "replace"), offset + len(data)


def _tidy_stack(text: str) -> str:
    """Drop the harness's own frames from a faulthandler dump: the parent-watch
    thread, and the multiprocessing bootstrap below the worker loop."""
    blocks = []
    for block in text.strip().split("\n\n"):
        if "_worker.py" in block and " in watch" in block:
            continue
        lines = [
            ln
            for ln in block.splitlines()
            if "multiprocessing" + os.sep not in ln and '"<string>"' not in ln
        ]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def dump_stacks(
    pids: list[int], stack_paths: list[str], ranks: list[int]
) -> dict[int, str]:
    """Ask ``ranks`` to print their Python stacks; return what they printed.

    Each rank's faulthandler writes to ``stack_paths[rank]`` on ``STACK_SIGNAL``;
    only what it appends after the signal is returned, without the harness's frames.
    """
    if _worker.STACK_SIGNAL is None or not ranks:
        return {}
    sizes = {}
    for rank in ranks:
        path = stack_paths[rank]
        sizes[rank] = os.path.getsize(path) if os.path.exists(path) else 0
        try:
            os.kill(pids[rank], _worker.STACK_SIGNAL)
        except (OSError, IndexError):
            pass
    stacks: dict[int, str] = {}
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and len(stacks) < len(ranks):
        time.sleep(0.05)
        for rank in ranks:
            text, _ = read_from(stack_paths[rank], sizes[rank])
            if text.strip():
                stacks[rank] = text
    # One more short pause: a dump may still be being written.
    time.sleep(0.05)
    for rank in ranks:
        text, _ = read_from(stack_paths[rank], sizes[rank])
        if text.strip():
            stacks[rank] = text
    return {rank: _tidy_stack(text) for rank, text in stacks.items()}


def forward_output(
    out_paths: list[str], err_paths: list[str], offsets: dict[str, int]
) -> None:
    """Copy what the ranks printed since last time to this process's streams,
    each line prefixed with its rank (pytest then shows it with the test).

    ``offsets`` maps each output file to how much of it was already forwarded; it
    is advanced in place.
    """
    for rank in range(len(out_paths)):
        for path, stream in (
            (out_paths[rank], sys.stdout),
            (err_paths[rank], sys.stderr),
        ):
            text, offsets[path] = read_from(path, offsets[path])
            if text and stream is not None:
                lines = text.splitlines()
                stream.write("".join(f"[rank {rank}] {ln}\n" for ln in lines))
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()


def common_outcome(failures: dict[int, RankFailure], world_size: int) -> str | None:
    """``"skip"`` / ``"xfail"`` when every rank raised that pytest outcome."""
    kinds = {f.exc_type for f in failures.values()}
    if len(failures) != world_size or len(kinds) != 1:
        return None
    return _OUTCOME_PASSTHROUGH.get(kinds.pop())


def make_error(
    test_name: str,
    world_size: int,
    failures: dict[int, RankFailure],
    still_running: list[int],
    stacks: dict[int, str],
    timeout: float,
    elapsed: float,
) -> DistributedTestError:
    """The error for a call that failed on some rank (``DistributedTestError``) or
    timed out with none failed (``DistributedTimeoutError``): a summary naming the
    ranks, then each failed rank's traceback and each stuck rank's stacks."""
    lines: list[str] = []
    if failures:
        ranks = sorted(failures)
        summary = ", ".join(
            f"rank {r}: {failures[r].short_type}: {failures[r].message}".rstrip(": ")
            for r in ranks
        )
        lines.append(
            f"distributed test {test_name} failed on rank"
            f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
            f"of {world_size} ({summary})"
        )
        if still_running:
            lines.append(
                f"ranks {still_running} were still running {FAILURE_GRACE_S:.1f} s "
                "after the first failure (most likely blocked in a collective that "
                "the failed rank never joined)"
            )
        cls: type[DistributedTestError] = DistributedTestError
    else:
        lines.append(
            f"distributed test {test_name} timed out after {timeout:g} s: "
            f"rank{'s' if len(still_running) > 1 else ''} "
            f"{', '.join(map(str, still_running))} of {world_size} "
            f"{'were' if len(still_running) > 1 else 'was'} still inside it"
        )
        cls = DistributedTimeoutError
    lines.append(
        "the rank processes were killed; the next call starts a fresh pool "
        f"(the call ran {elapsed:.2f} s)"
    )
    for rank in sorted(failures):
        f = failures[rank]
        lines.append(f"\n--- rank {rank}: {f.short_type}: {f.message} ---")
        if f.traceback:
            lines.append(tail(f.traceback.rstrip()))
    for rank in still_running:
        stack = stacks.get(rank)
        if stack:
            lines.append(f"\n--- rank {rank} (still running) Python stacks ---")
            lines.append(tail(stack.rstrip(), 4000))
        else:
            lines.append(f"\n--- rank {rank} (still running): no stack dump ---")
    return cls(
        "\n".join(lines),
        test_name=test_name,
        world_size=world_size,
        failures=failures,
        still_running=still_running,
        stacks=stacks,
    )
