"""The scale simulation's machinery: simulated ranks, the worker processes and
threads they run in, and the TCPStore server they talk to.

``benchmarks.scale`` says what is simulated and why, runs the configurations and
turns their :class:`RankResult` s into rows; this module is the part that runs in
(or starts) other processes and threads. One simulated rank
(:func:`simulate_rank`) runs the library's rounds on the real transport: a
``StakeGroup`` of its stake (a gloo group of the stake's ranks, set up through its
own ``TCPStore`` client). A worker process (:func:`_worker`) holds many ranks, one
thread each; :class:`Workers` starts those processes (``forkserver``, which
preloads this module) and hands them one :class:`Job` per configuration.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from remat_dist.distributed._plan import PlanDigest
from remat_dist.distributed._stake_group import (
    StakeGroup,
    all_equal,
    stake_base,
    tagged_words,
)

__all__ = [
    "HOST",
    "STAKE_GROUP",
    "Job",
    "RankResult",
    "Workers",
    "raise_fd_limit",
    "simulate_rank",
    "start_server",
]

HOST = "127.0.0.1"
RESOLVER_NOISE = "hostname of the client socket cannot be retrieved"
STAKE_GROUP = "stake group"
"""Design name: per step, one agreement and one report among each stake's ranks on
their gloo group (what the library does)."""


# -- one simulated rank


@dataclass(frozen=True)
class Job:
    """One configuration, as sent to every worker."""

    prefix: str
    ranks: int
    group: int
    """Ranks per stake (the TP degree)."""
    design: str
    steps: int
    timeout: float
    stop_at: float
    """``time.monotonic()`` past which ranks stop between rounds."""


@dataclass
class RankResult:
    """One simulated rank's measurements of one configuration, per measured step."""

    rank: int
    enter: list[float] = field(default_factory=list)
    agreed: list[float] = field(default_factory=list)
    """When the step's agreement round ended (the report follows)."""
    leave: list[float] = field(default_factory=list)
    operations: list[int] = field(default_factory=list)
    """gloo operations this rank issued per step (one per round)."""
    requests: list[int] = field(default_factory=list)
    setup_requests: int = 0
    error: str | None = None


def _plan(rank: int, group: int) -> PlanDigest:
    """A step's plan: 8 blocks, each at stake on the rank's TP group."""
    plan = PlanDigest()
    for i in range(8):
        regions = [["attention", "recompute", "replay"], ["mlp", "recompute", "replay"]]
        plan.add([f"layers.{i}", "replay", regions], {f"tp{rank // group}/{group}": f"{i:016x}:2"})
    return plan


class _Stake:
    """The library's rounds for one step on the stake's gloo group, as ``_step``
    issues them: the agreement (the plan's two words, tagged: 6 int64) and the
    report (no failure: 6 int64). The group is made at the first round."""

    def __init__(self, store: Any, job: Job, rank: int) -> None:
        first = rank - rank % job.group
        ranks = tuple(range(first, first + job.group))
        self.words = _plan(rank, job.group).words()
        base = stake_base(job.prefix, ranks)
        self.group = StakeGroup(ranks, rank, store, base, 0)
        self.timeout = job.timeout

    def step(self, agreed: list[float]) -> None:
        got = self.group.reduce_max(tagged_words(1, self.words), self.timeout)
        agreed.append(time.monotonic())
        if not all_equal(got[2:], self.words):
            raise RuntimeError("the agreement found different plans")
        if self.group.reduce_max(tagged_words(2, [0, 0]), self.timeout)[2]:
            raise RuntimeError("the report found a failure")

    def counts(self) -> tuple[int, int]:
        return self.group.rounds, self.group.store_requests

    def close(self) -> None:
        self.group.close()


def simulate_rank(store: Any, job: Job, rank: int) -> RankResult:
    """Run ``job`` as rank ``rank`` on ``store`` (this rank's own client)."""
    out = RankResult(rank)
    sim: Any = None
    try:
        sim = _Stake(store, job, rank)
        sim.step([])  # warm-up: the group's set-up, at its first round
        out.setup_requests = sim.counts()[1]
        for _ in range(job.steps):
            if time.monotonic() > job.stop_at:
                raise TimeoutError("the configuration's time limit was reached")
            (m0, r0), t0 = sim.counts(), time.monotonic()
            sim.step(out.agreed)
            out.leave.append(time.monotonic())
            out.enter.append(t0)
            m1, r1 = sim.counts()
            out.operations.append(m1 - m0)
            out.requests.append(r1 - r0)
    except Exception as e:  # reported per rank, never raised in a thread
        out.error = f"{type(e).__name__}: {e}"
    finally:
        if sim is not None:
            sim.close()
    return out


# -- a worker process: many simulated ranks, one thread each


def _connect(port: int, ranks: list[int], timeout: float) -> dict[int, Any]:
    """One client per rank, made in parallel: a connection can stall for seconds
    where the resolver is slow (c10d looks up the peer's host name for its logs)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    wait = timedelta(seconds=timeout)

    def client(rank: int) -> Any:
        return dist.TCPStore(HOST, port, is_master=False, timeout=wait)

    threads = max(1, min(64, len(ranks)))
    with _stderr_without(RESOLVER_NOISE), ThreadPoolExecutor(threads) as pool:
        return dict(zip(ranks, pool.map(client, ranks), strict=True))


@contextlib.contextmanager
def _stderr_without(noise: str) -> Iterator[None]:
    """This process's stderr (C++ logs included) minus the lines holding ``noise``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if noise not in line))


def _run_job(job: Job, stores: dict[int, Any]) -> list[RankResult]:
    results: dict[int, RankResult] = {}
    mine = [r for r in stores if r < job.ranks]

    def run(rank: int) -> None:
        results[rank] = simulate_rank(stores[rank], job, rank)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in mine]
    for t in threads:
        t.start()
    end = job.stop_at + 2 * job.timeout + 5
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    late = "did not finish in time"
    return [results.get(r) or RankResult(r, error=late) for r in mine]


def _worker(conn: Any, port: int, ranks: list[int], timeout: float) -> None:
    """Entry point of a worker process: connect its ranks, then run jobs until told
    to stop (None) or the benchmark process is gone."""
    try:
        stores = _connect(port, ranks, timeout)
        conn.send("ready")
        parent = multiprocessing.parent_process()
        while True:
            if not conn.poll(1.0):
                if parent is not None and not parent.is_alive():
                    return
                continue
            job = conn.recv()
            if job is None:
                return
            conn.send(_run_job(job, stores))
    except (EOFError, BrokenPipeError):
        return
    except Exception as e:
        conn.send(f"{type(e).__name__}: {e}")
    finally:
        conn.close()


class Workers:
    """The worker processes; rank ``r`` lives in worker ``r % workers``."""

    def __init__(self, workers: int, ranks: int, port: int, timeout: float) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for w in range(min(workers, ranks)):
            here, there = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(there, port, list(range(w, ranks, workers)), timeout),
                daemon=True,
            )
            p.start()
            there.close()
            self.conns.append(here)
            self.procs.append(p)
        try:
            for reply in self._replies(time.monotonic() + 60 + timeout):
                if reply != "ready":
                    raise RuntimeError(f"a worker could not start: {reply}")
        except BaseException:
            self.close()
            raise

    def _replies(self, deadline: float) -> list[Any]:
        out = []
        for conn in self.conns:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError("a worker process did not answer in time")
            out.append(conn.recv())
        return out

    def run(self, job: Job) -> list[RankResult]:
        for conn in self.conns:
            conn.send(job)
        replies = self._replies(job.stop_at + 3 * job.timeout + 10)
        bad = [r for r in replies if not isinstance(r, list)]
        if bad:
            raise RuntimeError(f"a worker failed: {bad[0]}")
        return sorted((r for rs in replies for r in rs), key=lambda r: r.rank)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.conns:
            conn.close()


# -- the store server


def raise_fd_limit(ranks: int) -> None:
    """The server holds one socket per simulated rank."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = ranks + 256
        if soft < want and (hard == resource.RLIM_INFINITY or hard >= want):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


def start_server(timeout: float) -> Any:
    """The TCPStore server on a free port, listening on an IPv4 socket made here
    (its default IPv6 one sees 127.0.0.1 as ``::ffff:127.0.0.1``, a name that
    /etc/hosts does not hold: accepting a client then waits on DNS)."""
    import socket

    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((HOST, 0))
    listener.listen(4096)
    port = listener.getsockname()[1]
    return dist.TCPStore(
        HOST, port, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=timeout), master_listen_fd=listener.detach(),
    )
