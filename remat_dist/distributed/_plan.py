"""What ranks compare in an agreement: the plan of the checkpoints run since the last
one, as a short digest, and, when digests differ, the explanation every rank prints.

A checkpoint's plan entry is its name, its collective mode and each region's
decision and mode; next to it go the fingerprints of the collectives its forward
issued, per process group (``CollectiveLedger.group_fingerprints``: rank-invariant,
compared among that group's ranks only).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from typing import Any

__all__ = [
    "HEAD_ENTRIES",
    "PlanDigest",
    "explain",
    "failure_text",
    "fix_text",
]

HEAD_ENTRIES = 64
"""Plan entries each rank keeps (and sends) to explain a mismatch."""


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


@functools.lru_cache(maxsize=4096)
def _encoded(entry: tuple[Any, ...]) -> bytes:
    """A plan entry's JSON encoding (a model's checkpoints repeat the same few
    entries every step: each is encoded once)."""
    return json.dumps(entry, separators=(",", ":")).encode()


_BATCH = 256
"""Plan entries whose encodings are hashed together (see :class:`PlanDigest`)."""


class PlanDigest:
    """A running digest of plan entries (what one agreement compares).

    Every checkpoint forward adds an entry, so adding one only keeps it (frozen);
    they are encoded and hashed :data:`_BATCH` at a time and when the value is
    read (a hash of the concatenation, the same digest as hashing them one by
    one)."""

    __slots__ = ("_hasher", "_unhashed", "_groups", "count", "head")

    def __init__(self) -> None:
        self._hasher = hashlib.sha256()
        self._unhashed: list[tuple[Any, ...]] = []
        self._groups: dict[str, Any] = {}
        self.count = 0
        self.head: list[Any] = []

    def add(self, entry: Sequence[Any], group_fps: dict[str, str]) -> None:
        unhashed = self._unhashed
        unhashed.append(entry if isinstance(entry, tuple) else _frozen(entry))
        if len(unhashed) >= _BATCH:
            self._hash_unhashed()
        for key, fp in group_fps.items():
            h = self._groups.get(key)
            if h is None:
                h = self._groups[key] = hashlib.sha256()
            h.update(f"{self.count}:{fp}\n".encode())
        self.count += 1
        if len(self.head) < HEAD_ENTRIES:
            self.head.append([*entry, group_fps])

    def _hash_unhashed(self) -> None:
        self._hasher.update(b"".join(map(_encoded, self._unhashed)))
        self._unhashed.clear()

    def value(self) -> str:
        """The short string every rank must have equal."""
        if self._unhashed:
            self._hash_unhashed()
        return json.dumps(
            {
                "p": f"{self._hasher.hexdigest()[:16]}:{self.count}",
                "g": {k: h.hexdigest()[:16] for k, h in sorted(self._groups.items())},
            },
            separators=(",", ":"),
        )

    def words(self) -> list[int]:
        """The value as two 62-bit integers (what a round compares)."""
        d = hashlib.sha256(self.value().encode()).digest()
        mask = (1 << 62) - 1
        return [
            int.from_bytes(d[:8], "big") & mask,
            int.from_bytes(d[8:16], "big") & mask,
        ]

    def payload(self) -> bytes:
        """What this rank sends to explain a mismatch."""
        return json.dumps(
            {"v": self.value(), "head": self.head}, separators=(",", ":")
        ).encode()


def fix_text() -> str:
    return (
        "Every rank of a process group must run the same checkpoints in the same "
        "order with the same save/recompute decisions and collective modes, and "
        "issue the same collectives inside them (a decision that depends on the rank "
        "or on the data makes replays issue different collectives). Fix: derive "
        "region(..., recompute=...), collectives= and the checkpointed blocks from "
        "configuration shared by all ranks."
    )


def _group_mismatches(groups: dict[int, dict[str, str]]) -> list[str]:
    """Per process group: its ranks must hold equal fingerprints."""
    members: dict[str, dict[int, str]] = {}
    for r, g in groups.items():
        for key, fp in g.items():
            members.setdefault(key, {})[r] = fp
    out = []
    for key, fps in sorted(members.items()):
        if len(fps) != len(groups) or len(set(fps.values())) > 1:
            out.append(key)
    return out


def _flatten(plan: list[Any]) -> list[tuple[str, str]]:
    out = []
    for name, mode, regions, _ in plan:
        out.append((name, f"checkpoint, collectives={mode}"))
        out.extend(
            (f"{name}::{region}", f"{decision}, collectives={rmode}")
            for region, decision, rmode in regions
        )
    return out


def explain(plans: dict[int, dict[str, Any]], what: str) -> str:
    """The mismatch message from every rank's :meth:`PlanDigest.payload` (decoded);
    ``what`` names the agreement (``"the plan agreement of ranks [0, 1]"``)."""
    flat = {r: _flatten(p["head"]) for r, p in plans.items()}
    groups: dict[str, list[int]] = {}
    for r, f in sorted(flat.items()):
        groups.setdefault(json.dumps(f), []).append(r)
    if len(groups) > 1:
        ref_key = max(groups, key=lambda k: (len(groups[k]), -groups[k][0]))
        ref_ranks, ref = groups[ref_key], json.loads(ref_key)
        differ = sorted(r for k, rs in groups.items() if k != ref_key for r in rs)
        lines = []
        for r in differ:
            mine = flat[r]
            i = next(
                (i for i, (a, b) in enumerate(zip(mine, ref)) if tuple(a) != tuple(b)),
                min(len(mine), len(ref)),
            )
            theirs = (
                f"{mine[i][0]} ({mine[i][1]})" if i < len(mine) else "(nothing more)"
            )
            expected = (
                f"{ref[i][0]} ({ref[i][1]})" if i < len(ref) else "(nothing more)"
            )
            lines.append(
                f"  rank {r} at entry {i}: {theirs}   ranks {ref_ranks}: {expected}"
            )
        return (
            f"{what} failed: ranks {differ} ran another checkpoint/region plan than "
            f"ranks {ref_ranks}; first difference:\n"
            + "\n".join(lines)
            + "\n"
            + fix_text()
        )
    heads = {r: p["head"] for r, p in plans.items()}
    keys = _group_mismatches({r: json.loads(p["v"])["g"] for r, p in plans.items()})
    lines = []
    for key in keys:
        by_ckpt: dict[int, dict[int, str]] = {}
        for r, head in heads.items():
            for i, entry in enumerate(head):
                by_ckpt.setdefault(i, {})[r] = entry[3].get(key, "nothing")
        first = next(
            (i for i in sorted(by_ckpt) if len(set(by_ckpt[i].values())) > 1), None
        )
        if first is None:
            lines.append(
                f"  {_group_text(key)}: the ranks issued other collectives on it"
            )
            continue
        name = next(iter(heads.values()))[first][0]
        fps = by_ckpt[first]
        detail = "; ".join(
            f"ranks {sorted(r for r in fps if fps[r] == v)}: {_fp_text(v)}"
            for v in sorted(set(fps.values()))
        )
        lines.append(f"  checkpoint '{name}', {_group_text(key)}: {detail}")
    if not lines:
        lines.append("  (the plans differ past the entries kept to explain it)")
    return (
        f"{what} failed: the ranks of a process group recorded other collectives in "
        "a checkpoint's forward:\n" + "\n".join(lines) + "\n" + fix_text()
    )


def _group_text(key: str) -> str:
    name, _, size = key.rpartition("/")
    return f"process group '{name}' ({size} ranks)"


def _fp_text(v: str) -> str:
    if v == "nothing":
        return "no collective"
    fp, _, count = v.partition(":")
    return f"{count} collective(s), fingerprint {fp}"


def failure_text(
    rank: int, stake: tuple[int, ...], f: Any, what: str, timeout: float
) -> str:
    """The message of a round that failed (a ``RoundFailure``): who did not come,
    who gave up first, or who could not reach whom, and the fix."""
    if f.reason == "setup":
        return f"rank {rank}: {what} could not start: {f}."
    if f.reason == "aborted":
        who = f"ranks {f.missing}" if f.missing else "some rank(s)"
        head = (
            f"rank {rank}: {who} of {list(stake)} did not reach {what} in time "
            f"(rank {f.by} gave up waiting first)"
        )
    elif f.reason == "timeout":
        who = f"ranks {f.missing}" if f.missing else "some rank(s)"
        head = f"rank {rank}: {who} of {list(stake)} did not reach {what} within {timeout:g} s"
    elif f.reason == "closed":
        head = f"rank {rank}: {what} could not complete: {f}"
    else:
        head = f"rank {rank}: {what} is out of step: {f}"
    late = getattr(f, "came_late", None)
    if late is not None:
        head += (
            f" (this rank arrived after rank {late.by} had given up on the round; "
            "its peers did not meet it in their next round either)"
        )
    elif getattr(f, "late", False):
        head += (
            f" (this rank arrived after rank {f.by} had given up on the round)"
        )
    return (
        f"{head}: they stalled, died, raised earlier in this step, or run another "
        "number of steps. No rank of them issued a collective of this backward "
        "after it. Fix the failing rank (its own error says why); raise the bound "
        "with remat_dist.distributed.set_replay_timeout(seconds)."
    )
