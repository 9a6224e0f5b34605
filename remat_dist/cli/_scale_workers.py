"""The scale simulation's machinery: simulated ranks, the worker processes and
threads they run in, and the TCPStore server they talk to.

``remat_dist.cli.bench_scale`` says what is simulated and why, runs the
configurations and turns their :class:`RankResult` s into rows; this module is the
part that runs in (or starts) other processes and threads. One simulated rank
(:func:`simulate_rank`) runs the real ``StoreRound`` code on its own ``TCPStore``
client; a worker process (:func:`_worker`) holds many ranks, one thread each;
:class:`Workers` starts those processes (``forkserver``, which preloads this
module) and hands them one :class:`Job` per configuration.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
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

from remat_dist.distributed._step import _plans_differ
from remat_dist.distributed._store_round import StoreRound

__all__ = [
    "HOST",
    "PER_CHECKPOINT",
    "STEP",
    "Job",
    "RankResult",
    "Workers",
    "raise_fd_limit",
    "simulate_rank",
    "start_server",
]

HOST = "127.0.0.1"
RESOLVER_NOISE = "hostname of the client socket cannot be retrieved"
STEP = "step"
"""Design name: one exchange and one report per step (what the library does)."""
PER_CHECKPOINT = "per-checkpoint"
"""Design name: two exchange rounds per checkpoint per step (the design replaced)."""


# -- one simulated rank


@dataclass(frozen=True)
class Job:
    """One configuration, as sent to every worker."""

    prefix: str
    ranks: int
    checkpoints: int
    design: str
    steps: int
    timeout: float
    stop_at: float
    """``time.monotonic()`` past which ranks stop between rounds."""


@dataclass
class RankResult:
    """One simulated rank's measurements of one configuration."""

    rank: int
    enter: list[float] = field(default_factory=list)
    leave: list[float] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    hash_s: list[float] = field(default_factory=list)
    error: str | None = None


class PlanHash:
    """The plan digest of one step as ``StepAgreement.add_checkpoint`` and
    ``StepAgreement._value`` compute it, without a process group."""

    def __init__(self) -> None:
        self.plan = hashlib.sha256()
        self.groups: dict[str, Any] = {}
        self.count = 0

    def add(self, entry: list[Any], group_fps: dict[str, str]) -> None:
        self.plan.update(json.dumps(entry, separators=(",", ":")).encode())
        for key, fp in group_fps.items():
            h = self.groups.setdefault(key, hashlib.sha256())
            h.update(f"{self.count}:{fp}\n".encode())
        self.count += 1

    def value(self) -> str:
        groups = {k: h.hexdigest()[:16] for k, h in sorted(self.groups.items())}
        plan = f"{self.plan.hexdigest()[:16]}:{self.count}"
        return json.dumps({"p": plan, "g": groups}, separators=(",", ":"))


def _plan_entry(i: int) -> list[Any]:
    regions = [["attention", "recompute", "replay"], ["mlp", "recompute", "replay"]]
    return [f"layers.{i}", "replay", regions]


def _group_fps(i: int, rank: int, ranks: int) -> dict[str, str]:
    """A tensor-parallel group of 8 (or all ranks) and the world, as a model
    sharded both ways records them; equal among each group's ranks."""
    tp = 8 if ranks % 8 == 0 else ranks
    fp = hashlib.sha256(f"collectives of checkpoint {i}".encode()).hexdigest()[:16]
    return {f"tp{rank // tp}/{tp}": f"{fp}:2", f"world/{ranks}": f"{fp}:1"}


def _step_values(job: Job, rank: int) -> tuple[list[str], float]:
    """One step's values to post (per-step design: one; per-checkpoint design: one
    per checkpoint, each posted twice) and the thread time spent hashing them."""
    t0 = time.thread_time()
    plan = PlanHash()
    values = []
    for i in range(job.checkpoints):
        entry = _plan_entry(i)
        plan.add(entry, _group_fps(i, rank, job.ranks))
        values.append(f"{plan.plan.hexdigest()[:16]}:{i}")
    if job.design == STEP:
        values = [plan.value()]
    return values, time.thread_time() - t0


def _agreed(verdict: dict[int, str] | None, what: str) -> None:
    if verdict is not None:
        ranks = sorted(verdict)[:8]
        raise RuntimeError(f"{what}: the ranks' values differed: {ranks}")


def _run_step(rnd: StoreRound, job: Job, values: list[str]) -> None:
    if job.design == STEP:
        verdict = rnd.exchange(values[0], timeout=job.timeout, judge=_plans_differ)
        _agreed(verdict, "exchange")
        _agreed(rnd.report(None, timeout=job.timeout), "report")
        return
    for value in values:
        for _ in range(2):
            _agreed(rnd.exchange(value, timeout=job.timeout), "per-checkpoint round")


def _warm_up(rnd: StoreRound, job: Job) -> None:
    """One round pair, so that the measured rounds delete keys as a long run does."""
    if job.design == STEP:
        values, _ = _step_values(job, rnd.rank)
        _run_step(rnd, job, values)
    else:
        _run_step(rnd, job, ["warm-up"])


def simulate_rank(store: Any, job: Job, rank: int) -> RankResult:
    """Run ``job`` as rank ``rank`` on ``store`` (this rank's own client)."""
    import torch.distributed as dist

    out = RankResult(rank)
    try:
        prefixed = dist.PrefixStore(job.prefix, store)
        rnd = StoreRound(prefixed, tuple(range(job.ranks)), rank)
        steps = [_step_values(job, rank) for _ in range(job.steps)]
        _warm_up(rnd, job)
        for values, hash_s in steps:
            if time.monotonic() > job.stop_at:
                raise TimeoutError("the configuration's time limit was reached")
            before, t0 = rnd.requests, time.monotonic()
            _run_step(rnd, job, values)
            out.leave.append(time.monotonic())
            out.enter.append(t0)
            out.requests.append(rnd.requests - before)
            out.hash_s.append(hash_s)
    except Exception as e:  # reported per rank, never raised in a thread
        out.error = f"{type(e).__name__}: {e}"
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
