"""The three observers of a checkpoint's collectives: record (forward), verify and
serve (replay).

A replay knows before it starts exactly which collectives it must issue: the
forward's ledger minus the entries of skipped save regions, cut where torch's early
stop will end it (``CollectiveEntry.packs_before``). Verification compares every
collective with the next expected entry *before* issuing it. When this rank's
replay diverges (another collective, one too many, one missing) or raises, it
*releases* the expected entries it has not issued, on zero buffers, so that every
peer's replay completes with the same collectives in the same order (no peer is
left waiting, nothing pairs with a different collective) and the process group
stays aligned; the failure is then reported at the end of backward by the step
agreement (``_step``), on every rank. A collective that fails (a timeout, a dead
peer) is not released: the error is raised at once, marked as a communication
failure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from remat_dist._errors import CollectiveReplayError
from remat_dist.distributed._intercept import CollectiveCall
from remat_dist.distributed._ledger import (
    CollectiveEntry,
    CollectiveLedger,
    _completed_result,
    _work_of,
)
from remat_dist.distributed._ready import this_rank

__all__ = [
    "RecordCollectives",
    "ServeCollectives",
    "VerifyCollectives",
    "is_comm_failure",
]

_COMM_MARKERS = (
    "gloo/",
    "NCCL",
    "Connection closed",
    "Connection reset",
    "Timed out",
    "timed out",
    "Broken pipe",
)


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the communication layer (a collective timed out, a
    peer died): such a failure cannot be released, the process group is broken."""
    if getattr(exc, "comm_failure", False):
        return True
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(m in text for m in _COMM_MARKERS)


class RecordCollectives:
    """Record mode: append one :class:`CollectiveEntry` per collective to ``ledger``.

    ``keep_outputs=True`` also keeps what each servable collective wrote (waiting for
    it inside the kernel, then cloning), for :class:`ServeCollectives`. ``packs``
    returns how many tensors the checkpoint has saved so far (stamped on entries).
    """

    def __init__(
        self,
        ledger: CollectiveLedger | None = None,
        *,
        keep_outputs: bool = False,
        packs: Callable[[], int] | None = None,
    ) -> None:
        self.ledger = ledger if ledger is not None else CollectiveLedger()
        self.keep_outputs = keep_outputs
        self.packs = packs

    def on_collective(self, call: CollectiveCall, issue: Callable[[], Any]) -> Any:
        _ = call.signature  # computed (and cached) before the op writes its buffers
        packs_before = self.packs() if self.packs is not None else -1
        result = issue()
        kept = None
        if self.keep_outputs and call._servable():
            work = _work_of(result, call._spec)
            if work is not None:
                work.wait()
            kept = tuple(t.detach().clone() for t in call.output_tensors())
        self.ledger.append(CollectiveEntry.of(call, len(self.ledger), kept, packs_before))
        return result


_FIX = (
    "A replay must issue the collectives its forward issued, in the same order, "
    "groups, shapes and dtypes, on every rank: keep the checkpointed function's "
    "collectives independent of data that changes between forward and replay (and "
    "restore RNG state with recompute_state_hooks), or use collectives='save' so the "
    "replay issues none."
)


class VerifyCollectives:
    """Verify mode: check each collective against the next ``expected`` entry, then
    issue it (with ``op_timeout`` seconds as its timeout, where the op takes one).

    A mismatch raises :class:`CollectiveReplayError` before anything is issued; the
    expected entries not yet issued are released first (:meth:`diverge`).
    :meth:`finish` releases and reports entries the replay never reached.
    ``failure`` holds the first divergence's message.
    """

    _serving = False

    def __init__(
        self,
        expected: Sequence[CollectiveEntry],
        *,
        label: str,
        rank: int | None = None,
        op_timeout: float | None = None,
        forward_total: int | None = None,
    ) -> None:
        self.expected = list(expected)
        self.label = label
        self.rank = this_rank() if rank is None else rank
        self.op_timeout = op_timeout
        self.forward_total = len(self.expected) if forward_total is None else forward_total
        self.position = 0
        self.issued = 0
        self.served = 0
        self.failure: str | None = None

    # -- per collective
    def on_collective(self, call: CollectiveCall, issue: Callable[[], Any]) -> Any:
        if self.failure is not None:
            raise CollectiveReplayError(self.failure)
        pos = self.position
        expected = self.expected[pos] if pos < len(self.expected) else None
        if expected is None or expected.signature != call.signature:
            message = self._mismatch_message(pos, expected, call)
            self.diverge(message)
            raise CollectiveReplayError(message)
        self.position = pos + 1
        return self._perform(call, issue, expected)

    def _perform(
        self, call: CollectiveCall, issue: Callable[[], Any], expected: CollectiveEntry
    ) -> Any:
        if self.op_timeout is not None:
            call.set_timeout(self.op_timeout)
        self.issued += 1
        try:
            return issue()
        except Exception as exc:
            if not is_comm_failure(exc):
                raise
            err = CollectiveReplayError(
                f"{self._where()}: replayed collective {self.position} of "
                f"{len(self.expected)} ({expected.describe()}) failed: {exc}. A rank "
                f"of group '{expected.group_name}' (ranks {list(expected.group_ranks)}) "
                "did not join it in time: it stalled, died, or failed before this "
                "replay. The process group cannot be used after this; restart the job "
                "(torchrun --max-restarts) or raise the bound with "
                "remat_dist.distributed.set_replay_timeout(seconds)."
            )
            err.comm_failure = True  # type: ignore[attr-defined]
            raise err from exc

    def _issues(self, entry: CollectiveEntry) -> bool:
        """Whether this mode issues ``entry`` (so peers wait for it)."""
        return True

    # -- messages
    def _where(self) -> str:
        rank = "" if self.rank is None else f"rank {self.rank}, "
        return f"{rank}checkpoint '{self.label}'"

    def _mismatch_message(
        self, pos: int, expected: CollectiveEntry | None, call: CollectiveCall
    ) -> str:
        n = len(self.expected)
        if expected is None:
            exp = f"nothing more (this replay issues {n} of the forward's {self.forward_total} collective(s))"
        else:
            exp = f"{expected.describe()} (forward ledger #{expected.position})"
        mode = "serving" if self._serving else "replay"
        return (
            f"{self._where()}: collective {pos + 1} of the {mode} differs from the "
            f"forward's ledger.\n  expected: {exp}\n  actual:   {call.describe()}\n"
            f"{_FIX}"
        )

    # -- failure
    def diverge(self, message: str) -> None:
        """Record the first failure and release the expected entries not issued."""
        if self.failure is not None:
            return
        self.failure = message
        self._release(self.position)

    def fail(self, exc: BaseException) -> str:
        """The replay raised ``exc`` (not a communication failure): release the rest;
        returns the failure's message."""
        if self.failure is None:
            if isinstance(exc, CollectiveReplayError):
                self.diverge(str(exc))
            else:
                self.diverge(
                    f"{self._where()}: the replay raised {type(exc).__name__}: {exc} "
                    f"after {self.position} of its {len(self.expected)} collective(s)."
                )
        assert self.failure is not None
        return self.failure

    def finish(self) -> str | None:
        """End of a replay that raised nothing: entries it never reached are released
        and reported. Returns the failure's message, or None."""
        if self.failure is None and self.position < len(self.expected):
            missing = self.expected[self.position :]
            listed = "\n".join(f"  #{e.position}: {e.describe()}" for e in missing[:8])
            more = f"\n  ... and {len(missing) - 8} more" if len(missing) > 8 else ""
            self.diverge(
                f"{self._where()}: the replay ended after {self.position} of its "
                f"{len(self.expected)} collective(s); missing:\n{listed}{more}\n{_FIX}"
            )
        return self.failure

    def _release(self, start: int) -> None:
        works = []
        for e in self.expected[start:]:
            if self._issues(e):
                try:
                    works.append(e._issue_dummy(self.op_timeout))
                except Exception:
                    break
        bound = timedelta(seconds=self.op_timeout or 60.0)
        for w in works:
            if w is not None:
                with contextlib.suppress(Exception):
                    w.wait(bound)


class ServeCollectives(VerifyCollectives):
    """Serve mode ("comm-free replay"): verify each collective, then, instead of
    issuing it, write the outputs kept on forward into its buffers and return a
    completed ``Work``. Entries recorded without kept outputs (not servable, or
    recorded with ``keep_outputs=False``) are issued, as in verify mode.
    """

    _serving = True

    def _issues(self, entry: CollectiveEntry) -> bool:
        return entry.kept is None

    def _perform(
        self, call: CollectiveCall, issue: Callable[[], Any], expected: CollectiveEntry
    ) -> Any:
        kept = expected.kept
        if kept is None:
            return super()._perform(call, issue, expected)
        written = call.output_tensors()
        with torch.no_grad():
            for dst, src in zip(written, kept, strict=True):
                dst.data.copy_(src)
        self.served += 1
        return _completed_result(call, written)
