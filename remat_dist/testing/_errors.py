"""Errors raised in the parent process when a distributed test body fails."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

__all__ = ["DistributedTestError", "DistributedTimeoutError", "RankFailure"]


@dataclass
class RankFailure:
    """What went wrong on one rank.

    Attributes:
        rank: the rank that failed.
        exc_type: qualified name of the remote exception's type
            (``"builtins.AssertionError"``), or ``"<process exit>"`` when the worker
            process died.
        message: ``str()`` of the remote exception.
        traceback: the remote traceback, formatted as Python prints it.
        exception_bytes: the pickled remote exception, when it could be pickled.
    """

    rank: int
    exc_type: str
    message: str
    traceback: str
    exception_bytes: bytes | None = field(default=None, repr=False)

    @property
    def exception(self) -> BaseException | None:
        """The remote exception object, rebuilt in this process (None if it could
        not be pickled on the rank or unpickled here)."""
        if self.exception_bytes is None:
            return None
        try:
            exc = pickle.loads(self.exception_bytes)
        except Exception:
            return None
        return exc if isinstance(exc, BaseException) else None

    @property
    def short_type(self) -> str:
        """The exception type without its module (``"AssertionError"``)."""
        return self.exc_type.rsplit(".", 1)[-1]


class DistributedTestError(AssertionError):
    """A function run on several ranks failed on one or more of them.

    It is an ``AssertionError`` so that pytest reports a failing rank as a test
    failure (not an error in the harness). The message names the test, the failing
    ranks and includes each one's remote traceback.

    Attributes:
        test_name: the pytest node id (or the function's qualified name).
        world_size: number of ranks the function ran on.
        failures: ``{rank: RankFailure}`` for every rank that raised or died.
        still_running: ranks that had not finished when the harness gave up on them
            (blocked, most likely in a collective waiting for a failed rank).
        stacks: ``{rank: text}`` Python stacks dumped from the ranks still running.
    """

    def __init__(
        self,
        message: str,
        *,
        test_name: str,
        world_size: int,
        failures: dict[int, RankFailure],
        still_running: list[int],
        stacks: dict[int, str],
    ) -> None:
        super().__init__(message)
        self.test_name = test_name
        self.world_size = world_size
        self.failures = failures
        self.still_running = still_running
        self.stacks = stacks

    @property
    def failed_ranks(self) -> list[int]:
        """Sorted ranks that raised (or whose process died)."""
        return sorted(self.failures)


class DistributedTimeoutError(DistributedTestError):
    """No rank failed, but some were still inside the function at its timeout.

    ``still_running`` names them; ``stacks`` holds where each one was stuck.
    """
