"""The parent side of the test harness: pools of rank processes, reused per call.

One pool per world size and parent process (so one per pytest-xdist worker). A pool
is started on first use and kept: later calls only pickle a function reference down
a pipe. A call that fails, hangs or breaks the process group *poisons* the pool:
it is killed at once and a new one is started in the background, so the next call
does not inherit a half-finished collective.
"""

from __future__ import annotations

import atexit
import inspect
import itertools
import math
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from remat_dist.testing import _worker
from remat_dist.testing._errors import (
    DistributedTestError,
    DistributedTimeoutError,
    RankFailure,
)
from remat_dist.testing._worker import FnRef, Task

__all__ = [
    "run_distributed",
    "shutdown_pools",
    "pool_stats",
    "PoolStats",
    "START_METHOD_ENV",
]

START_METHOD_ENV = "REMAT_DIST_TEST_START_METHOD"
"""Set to ``spawn`` or ``forkserver`` to choose how rank processes start."""

START_TIMEOUT_S = 180.0
"""Longest wait for a pool's processes to import torch and join the group."""

FAILURE_GRACE_S = 1.0
"""After the first rank fails, how long to wait for the others before giving up on
them (they are usually blocked in a collective that the failed rank never joins)."""

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

_OUTCOME_PASSTHROUGH = {
    "_pytest.outcomes.Skipped": "skip",
    "_pytest.outcomes.XFailed": "xfail",
}
"""Exceptions that, raised on every rank, are re-raised as they are (pytest.skip)."""


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


def _tail(text: str, limit: int = 6000) -> str:
    if len(text) <= limit:
        return text
    return "...(cut)...\n" + text[-limit:]


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


def _read_from(path: str, offset: int) -> tuple[str, int]:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return "", offset
    return data.decode("utf-8", "replace"), offset + len(data)


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
            self.offsets[path] = _read_from(path, 0)[1]

    def _fail_start(self, what: str) -> None:
        logs = []
        for rank in self._ranks:
            err, _ = _read_from(self.err_paths[rank], 0)
            if err.strip():
                logs.append(f"--- rank {rank} stderr ---\n{_tail(err, 3000)}")
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

    # -- diagnostics ---------------------------------------------------------

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask ``ranks`` to print their Python stacks; return what they printed."""
        if _worker.STACK_SIGNAL is None or not ranks:
            return {}
        sizes = {}
        for rank in ranks:
            path = self.stack_paths[rank]
            sizes[rank] = os.path.getsize(path) if os.path.exists(path) else 0
            try:
                os.kill(self.pids[rank], _worker.STACK_SIGNAL)
            except (OSError, IndexError):
                pass
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and len(stacks) < len(ranks):
            time.sleep(0.05)
            for rank in ranks:
                text, _ = _read_from(self.stack_paths[rank], sizes[rank])
                if text.strip():
                    stacks[rank] = text
        # One more short pause: a dump may still be being written.
        time.sleep(0.05)
        for rank in ranks:
            text, _ = _read_from(self.stack_paths[rank], sizes[rank])
            if text.strip():
                stacks[rank] = text
        return {rank: _tidy_stack(text) for rank, text in stacks.items()}

    def forward_output(self) -> None:
        """Copy what the ranks printed since last time to this process's streams,
        each line prefixed with its rank (pytest then shows it with the test)."""
        for rank in self._ranks:
            for path, stream in (
                (self.out_paths[rank], sys.stdout),
                (self.err_paths[rank], sys.stderr),
            ):
                text, self.offsets[path] = _read_from(path, self.offsets[path])
                if text and stream is not None:
                    lines = text.splitlines()
                    stream.write("".join(f"[rank {rank}] {ln}\n" for ln in lines))
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()

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
            stacks = self.dump_stacks(still_running)
        elapsed = time.monotonic() - t_start
        if failures or still_running:
            outcome = _common_outcome(failures, self.world_size)
            if outcome is not None and not still_running:
                # pytest.skip()/xfail() on every rank: the test is skipped/xfailed,
                # and the group is as healthy as after a pass.
                self.forward_output()
                import pytest

                getattr(pytest, outcome)(failures[0].message)
            # A collective may have completed on some ranks only: never reuse.
            self.broken = True
            self.forward_output()
            raise _make_error(
                task.test_name,
                self.world_size,
                failures,
                still_running,
                stacks,
                timeout,
                elapsed,
            )
        self.forward_output()
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


def _common_outcome(failures: dict[int, RankFailure], world_size: int) -> str | None:
    """``"skip"`` / ``"xfail"`` when every rank raised that pytest outcome."""
    kinds = {f.exc_type for f in failures.values()}
    if len(failures) != world_size or len(kinds) != 1:
        return None
    return _OUTCOME_PASSTHROUGH.get(kinds.pop())


def _make_error(
    test_name: str,
    world_size: int,
    failures: dict[int, RankFailure],
    still_running: list[int],
    stacks: dict[int, str],
    timeout: float,
    elapsed: float,
) -> DistributedTestError:
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
            lines.append(_tail(f.traceback.rstrip()))
    for rank in still_running:
        stack = stacks.get(rank)
        if stack:
            lines.append(f"\n--- rank {rank} (still running) Python stacks ---")
            lines.append(_tail(stack.rstrip(), 4000))
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


# -- registry ---------------------------------------------------------------

_pools: dict[int, _Pool] = {}
_stats: dict[int, PoolStats] = {}
_lock = threading.RLock()
_shutting_down = False


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
    global _shutting_down
    _shutting_down = True
    shutdown_pools()


def _describe(fn: Any) -> str:
    mod = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{mod}.{name}"


def _current_test_name(fn: Any) -> str:
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    if current:
        return current.rsplit(" (", 1)[0]
    return _describe(fn)


def fn_reference(
    fn: Callable[..., Any], *, method: bool = False, wants_ctx: bool = False
) -> Any:
    """What to send to the ranks for ``fn``: an import reference for a module-level
    function, else ``fn`` itself when it pickles (a ``functools.partial`` of one)."""
    if inspect.isfunction(fn):
        qualname = fn.__qualname__
        if "<locals>" in qualname or "<lambda>" in qualname:
            raise TypeError(
                f"{_describe(fn)} cannot run on other ranks: the rank processes "
                "import the function by name, so define it at module level (not "
                "inside another function, and not as a lambda)"
            )
        name = fn.__module__
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if name == "__main__":
            # ``python -m pkg.mod``: the ranks can import pkg.mod by its real name.
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.name:
                name = spec.name
        return FnRef(name, qualname, file, method, wants_ctx)
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"{fn!r} cannot be sent to the rank processes ({exc}); pass a "
            "module-level function"
        ) from exc
    return fn


def _check_mesh(
    world_size: int,
    mesh_shape: tuple[int, ...] | None,
    mesh_dim_names: tuple[str, ...] | None,
) -> tuple[tuple[int, ...] | None, tuple[str, ...] | None]:
    if mesh_shape is None:
        if mesh_dim_names is not None:
            raise ValueError("mesh_dim_names needs mesh_shape")
        return None, None
    shape = tuple(int(s) for s in mesh_shape)
    if math.prod(shape) != world_size:
        raise ValueError(
            f"mesh_shape {shape} has {math.prod(shape)} ranks, world_size is "
            f"{world_size}"
        )
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    if names is not None and len(names) != len(shape):
        raise ValueError(f"mesh_dim_names {names} does not match mesh_shape {shape}")
    return shape, names


def run_task(
    fn_ref: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    world_size: int,
    timeout: float,
    mesh_shape: tuple[int, ...] | None,
    mesh_dim_names: tuple[str, ...] | None,
    test_name: str,
) -> list[Any]:
    """Run one prepared call on a pool (shared by run_distributed and the
    decorator)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    shape, names = _check_mesh(world_size, mesh_shape, mesh_dim_names)
    with _lock:
        if _shutting_down:
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
            task = Task(
                fn=fn_ref,
                args=tuple(args),
                kwargs=dict(kwargs),
                mesh_shape=shape,
                mesh_dim_names=names,
                shared_dir=shared_dir,
                test_name=test_name,
            )
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
                if not _shutting_down and not interrupted:
                    # Start the replacement now: it imports while the failure is
                    # reported and the next tests run.
                    try:
                        _new_pool(world_size)
                    except Exception:
                        _pools.pop(world_size, None)


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 60.0,
    mesh_shape: tuple[int, ...] | None = None,
    mesh_dim_names: tuple[str, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result.

    The ranks are real processes in a real gloo process group (CPU), started once
    per world size in this process and reused by later calls. Inside ``fn``,
    ``torch.distributed`` is initialised and :func:`dist_context` gives the rank,
    the world size, the mesh and a shared scratch directory.

    Args:
        fn: a module-level function (the ranks import it by name); ``args``,
            ``kwargs`` and the return value must pickle.
        world_size: number of ranks.
        timeout: seconds the call may take once the pool is ready. When it passes,
            the ranks still inside ``fn`` are named (with their Python stacks),
            the pool is killed and replaced, and ``DistributedTimeoutError`` is
            raised.
        mesh_shape / mesh_dim_names: build (once, then cache) a ``DeviceMesh`` with
            ``init_device_mesh("cpu", mesh_shape, mesh_dim_names=...)``, available
            as ``dist_context().mesh``.
        kwargs: keyword arguments for ``fn``.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        DistributedTestError: ``fn`` raised on some rank (or a rank's process died).
            The message names the failing ranks and carries their remote
            tracebacks. When one rank fails while the others block in a collective,
            the error comes about a second after the failure, not at the timeout.
        DistributedTimeoutError: no rank failed but some did not finish in time.
    """
    ref = fn_reference(fn)
    return run_task(
        ref,
        args,
        kwargs or {},
        world_size=world_size,
        timeout=timeout,
        mesh_shape=mesh_shape,
        mesh_dim_names=mesh_dim_names,
        test_name=_current_test_name(fn),
    )
