"""The pool of rank processes: start, reuse and replace, one per world size.

One pool per world size and parent process (so one per pytest-xdist worker). A pool
is started on first use and kept: later calls only pickle a task down a pipe. A
call that fails, hangs or breaks the process group *poisons* the pool: it is killed
at once and a new one is started in the background, so the next call does not
inherit a half-finished collective. What a failed call reports (tracebacks, stacks
of the stuck ranks) is built by ``_diagnostics``; the entry points that turn a
function into a task are in ``_run``.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait
from typing import Any

from remat_dist.testing import _worker
from remat_dist.testing._diagnostics import (
    FAILURE_GRACE_S,
    common_outcome,
    dump_stacks,
    forward_output,
    make_error,
    read_from,
    tail,
)
from remat_dist.testing._errors import RankFailure
from remat_dist.testing._worker import Task

__all__ = [
    "run_on_pool",
    "shutdown_pools",
    "pool_stats",
    "PoolStats",
    "START_METHOD_ENV",
]

START_METHOD_ENV = "REMAT_DIST_TEST_START_METHOD"
"""Set to ``spawn`` or ``forkserver`` to choose how rank processes start."""

START_TIMEOUT_S = 180.0
"""Longest wait for a pool's processes to import torch and join the group."""

PG_TIMEOUT_S = 600.0
"""Timeout of the workers' gloo process group (the harness's own timeouts act
first; this only bounds an orphaned worker)."""

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
]
"""Imported once by the fork server, so that each rank starts in milliseconds."""


@dataclass
class PoolStats:
    """What a world size's pools have cost in this process.

    Attributes:
        world_size: ranks per pool.
        starts: pools started (1 + replacements).
        last_start_s: wall time from launching the last pool to all ranks ready.
        calls: calls run.
        pids: process ids of the current pool's ranks (empty until ready).
        start_method: ``forkserver`` or ``spawn``.
    """

    world_size: int
    starts: int = 0
    last_start_s: float | None = None
    calls: int = 0
    pids: list[int] = field(default_factory=list)
    start_method: str = ""


def _start_method() -> str:
    methods = mp.get_all_start_methods()
    chosen = os.environ.get(START_METHOD_ENV, "").strip()
    if chosen:
        if chosen not in methods or chosen == "fork":
            raise ValueError(
                f"{START_METHOD_ENV}={chosen!r}: use 'spawn' or 'forkserver' "
                f"(available: {methods}); 'fork' hangs once torch ran threads"
            )
        return chosen
    return "forkserver" if "forkserver" in methods else "spawn"


def _worker_env() -> dict[str, str]:
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if (
        "GLOO_SOCKET_IFNAME" not in os.environ
        and sys.platform.startswith("linux")
        and os.path.exists("/sys/class/net/lo")
    ):
        # All ranks are on this machine: loopback needs no hostname resolution.
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


class _Pool:
    """``world_size`` rank processes in one gloo group, plus their pipes."""

    _ids = itertools.count()

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.method = _start_method()
        self.dir = tempfile.mkdtemp(prefix=f"remat_dist_ranks{world_size}_")
        self.broken = False
        self.ready = False
        self.pids: list[int] = []
        self.start_seconds: float | None = None
        self._t0 = time.monotonic()
        ctx = mp.get_context(self.method)
        if self.method == "forkserver":
            # Only has an effect before the fork server first starts.
            ctx.set_forkserver_preload(_PRELOAD)
        self.conns: list[Any] = []
        self.alive: list[Any] = []
        self.procs: list[Any] = []
        self.out_paths = [os.path.join(self.dir, f"rank{r}.out") for r in self._ranks]
        self.err_paths = [os.path.join(self.dir, f"rank{r}.err") for r in self._ranks]
        self.stack_paths = [
            os.path.join(self.dir, f"rank{r}.stack") for r in self._ranks
        ]
        self.offsets = {p: 0 for p in self.out_paths + self.err_paths}
        store_path = os.path.join(self.dir, "store")
        env = _worker_env()
        try:
            for rank in self._ranks:
                parent_conn, child_conn = ctx.Pipe()
                alive_r, alive_w = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_worker.worker_main,
                    name=f"remat_dist-rank{rank}-of-{world_size}",
                    kwargs={
                        "rank": rank,
                        "world_size": world_size,
                        "store_path": store_path,
                        "conn": child_conn,
                        "alive": alive_r,
                        "out_path": self.out_paths[rank],
                        "err_path": self.err_paths[rank],
                        "stack_path": self.stack_paths[rank],
                        "pg_timeout_s": PG_TIMEOUT_S,
                        "env": env,
                    },
                )
                proc.start()
                child_conn.close()
                alive_r.close()
                self.conns.append(parent_conn)
                self.alive.append(alive_w)
                self.procs.append(proc)
        except BaseException:
            self.kill()
            raise

    @property
    def _ranks(self) -> range:
        return range(self.world_size)

    # -- lifecycle -----------------------------------------------------------

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        if self.ready:
            return
        deadline = self._t0 + timeout
        pending = set(self._ranks)
        pids: dict[int, int] = {}
        while pending:
            remaining = deadline - time.monotonic()
            objs = [self.conns[r] for r in pending]
            objs += [self.procs[r].sentinel for r in pending]
            ready = wait(objs, timeout=max(0.0, remaining)) if remaining > 0 else []
            if not ready:
                self._fail_start(
                    f"ranks {sorted(pending)} were not ready after {timeout:.0f} s"
                )
            for rank in sorted(pending):
                conn = self.conns[rank]
                if conn in ready or conn.poll():
                    try:
                        msg = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        msg = None
                    if msg is not None and msg[0] == "ready":
                        pids[rank] = msg[2]
                        pending.discard(rank)
                        continue
                    if msg is not None and msg[0] == "init_error":
                        self._fail_start(
                            f"rank {rank} failed to join the process group:\n{msg[2]}"
                        )
                if self.procs[rank].sentinel in ready:
                    self.procs[rank].join(0.1)
                    code = self.procs[rank].exitcode
                    self._fail_start(
                        f"rank {rank} exited (code {code}) before it was ready. "
                        "If run_distributed is called from a script, guard the "
                        "call with `if __name__ == '__main__':` (each rank "
                        "imports the main module, as with any multiprocessing "
                        "code)"
                    )
        self.pids = [pids[r] for r in self._ranks]
        self.ready = True
        self.start_seconds = time.monotonic() - self._t0
        # Start-up chatter (import warnings) is not any test's output.
        for path in self.offsets:
            self.offsets[path] = read_from(path, 0)[1]

    def _fail_start(self, what: str) -> None:
        logs = []
        for rank in self._ranks:
            err, _ = read_from(self.err_paths[rank], 0)
            if err.strip():
                logs.append(f"--- rank {rank} stderr ---\n{tail(err, 3000)}")
        self.kill()
        raise RuntimeError(
            f"remat_dist.testing could not start a {self.world_size}-rank gloo pool "
            f"({self.method}): {what}" + ("\n" + "\n".join(logs) if logs else "")
        )

    def kill(self) -> None:
        self.broken = True
        for proc in self.procs:
            try:
                if proc.is_alive():
                    proc.kill()
            except Exception:
                pass
        for proc in self.procs:
            try:
                proc.join(5)
            except Exception:
                pass
        for conn in self.conns + self.alive:
            try:
                conn.close()
            except Exception:
                pass
        self.procs, self.conns, self.alive = [], [], []
        shutil.rmtree(self.dir, ignore_errors=True)

    def _forward_output(self) -> None:
        """Show with the current call what the ranks printed since the last one."""
        forward_output(self.out_paths, self.err_paths, self.offsets)

    # -- one call ------------------------------------------------------------

    def run(self, task: Task, timeout: float) -> list[Any]:
        self.wait_ready()
        task_id = next(self._ids)
        try:
            payload = pickle.dumps(task)
        except Exception as exc:
            raise TypeError(
                f"the arguments of {task.test_name} cannot be pickled to send to "
                f"the ranks: {exc}"
            ) from exc
        message = pickle.dumps(("run", task_id, payload))
        t_start = time.monotonic()
        try:
            for conn in self.conns:
                conn.send_bytes(message)
            results, failures, still_running = self._collect(task_id, t_start + timeout)
        except BaseException:
            # Ctrl-C, or a broken pipe: the ranks may still be inside the call.
            self.broken = True
            raise
        stacks: dict[int, str] = {}
        if still_running:
            self.broken = True
            stacks = dump_stacks(self.pids, self.stack_paths, still_running)
        elapsed = time.monotonic() - t_start
        if failures or still_running:
            outcome = common_outcome(failures, self.world_size)
            if outcome is not None and not still_running:
                # pytest.skip()/xfail() on every rank: the test is skipped/xfailed,
                # and the group is as healthy as after a pass.
                self._forward_output()
                import pytest

                getattr(pytest, outcome)(failures[0].message)
            # A collective may have completed on some ranks only: never reuse.
            self.broken = True
            self._forward_output()
            raise make_error(
                task.test_name,
                self.world_size,
                failures,
                still_running,
                stacks,
                timeout,
                elapsed,
            )
        self._forward_output()
        return [results[r] for r in self._ranks]

    def _collect(
        self, task_id: int, deadline: float
    ) -> tuple[dict[int, Any], dict[int, RankFailure], list[int]]:
        """Wait for every rank's reply until ``deadline``, or until
        ``FAILURE_GRACE_S`` after the first failure. Returns (results, failures,
        ranks still running)."""
        results: dict[int, Any] = {}
        failures: dict[int, RankFailure] = {}
        pending = set(self._ranks)
        first_failure_at: float | None = None
        while pending:
            now = time.monotonic()
            until = deadline
            if first_failure_at is not None:
                until = min(deadline, first_failure_at + FAILURE_GRACE_S)
            if now >= until:
                break
            objs = [self.conns[r] for r in pending]
            objs += [self.procs[r].sentinel for r in pending]
            ready = wait(objs, timeout=until - now)
            for rank in sorted(pending):
                conn = self.conns[rank]
                msg = None
                if conn in ready or conn.poll():
                    try:
                        msg = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        msg = None
                if msg is not None:
                    kind, got_id, body, clean = msg
                    pending.discard(rank)
                    if got_id != task_id:  # cannot happen: stale pools are killed
                        self.broken = True
                        failures[rank] = RankFailure(
                            rank, "<protocol>", f"stale reply {got_id}", ""
                        )
                        continue
                    if not clean:
                        self.broken = True
                    if kind == "ok":
                        try:
                            results[rank] = pickle.loads(body)
                        except Exception as exc:
                            failures[rank] = RankFailure(
                                rank,
                                type(exc).__module__ + "." + type(exc).__qualname__,
                                f"the return value of rank {rank} could not be "
                                f"unpickled in the parent: {exc}",
                                "",
                            )
                    else:
                        failures[rank] = RankFailure(**body)
                elif self.procs[rank].sentinel in ready:
                    self.procs[rank].join(0.1)
                    code = self.procs[rank].exitcode
                    pending.discard(rank)
                    self.broken = True
                    failures[rank] = RankFailure(
                        rank,
                        "<process exit>",
                        f"the process of rank {rank} exited with code {code} "
                        "while running the test",
                        "",
                    )
                if rank in failures and first_failure_at is None:
                    first_failure_at = time.monotonic()

        return results, failures, sorted(pending)


# -- registry ---------------------------------------------------------------


@dataclass
class _Pools:
    """The rank pools of this process, by world size (they outlive tests by
    design: starting ranks is what a pool saves)."""

    pools: dict[int, _Pool] = field(default_factory=dict)
    stats: dict[int, PoolStats] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    shutting_down: bool = False


_POOLS = _Pools()
_pools = _POOLS.pools
_stats = _POOLS.stats
_lock = _POOLS.lock


def _new_pool(world_size: int) -> _Pool:
    pool = _Pool(world_size)
    stats = _stats.setdefault(world_size, PoolStats(world_size))
    stats.starts += 1
    stats.start_method = pool.method
    stats.pids = []
    _pools[world_size] = pool
    return pool


def _get_pool(world_size: int) -> _Pool:
    pool = _pools.get(world_size)
    if pool is None or pool.broken:
        if pool is not None:
            pool.kill()
        pool = _new_pool(world_size)
    return pool


def shutdown_pools() -> None:
    """Kill every pool this process started (also done at interpreter exit)."""
    with _lock:
        for pool in list(_pools.values()):
            pool.kill()
        _pools.clear()


def pool_stats() -> dict[int, PoolStats]:
    """Per world size: how many pools were started, how long the last start took,
    how many calls ran, and the current ranks' process ids."""
    with _lock:
        return {ws: PoolStats(**vars(s)) for ws, s in _stats.items()}


@atexit.register
def _at_exit() -> None:
    _POOLS.shutting_down = True
    shutdown_pools()


def run_on_pool(world_size: int, task: Task, timeout: float) -> list[Any]:
    """Run ``task`` on the pool of ``world_size`` ranks; return each rank's result.

    The pool is started (or replaced, when the last call broke it) and awaited
    first; ``timeout`` counts from then. ``task.shared_dir`` is set to a fresh
    directory that lives for this call only. A call that breaks the pool kills it
    and starts its replacement at once, unless interrupted or shutting down.
    """
    with _lock:
        if _POOLS.shutting_down:
            raise RuntimeError("remat_dist.testing is shutting down")
        pool = _get_pool(world_size)
        stats = _stats[world_size]
        shared_dir = ""
        interrupted = False
        try:
            pool.wait_ready()
            if not stats.pids:
                stats.pids = list(pool.pids)
                stats.last_start_s = pool.start_seconds
            shared_dir = tempfile.mkdtemp(prefix="call_", dir=pool.dir)
            task = replace(task, shared_dir=shared_dir)
            stats.calls += 1
            return pool.run(task, timeout)
        except BaseException as exc:
            interrupted = not isinstance(exc, Exception)  # Ctrl-C, SystemExit
            if not pool.ready:
                pool.kill()
            raise
        finally:
            if shared_dir:
                shutil.rmtree(shared_dir, ignore_errors=True)
            if pool.broken and pool.ready:
                pool.kill()
                if not _POOLS.shutting_down and not interrupted:
                    # Start the replacement now: it imports while the failure is
                    # reported and the next tests run.
                    try:
                        _new_pool(world_size)
                    except Exception:
                        _pools.pop(world_size, None)
