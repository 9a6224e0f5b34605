"""The rank side of the test harness: one long-lived process per rank.

A worker joins a gloo process group once, then runs the functions its parent sends,
one at a time, until the parent closes the pipe (or dies). It never tears the group
down between calls: that is what makes a warm call cost milliseconds.

Wire protocol (pickled tuples over a ``multiprocessing`` pipe):

* worker -> parent at start: ``("ready", rank, pid, init_seconds)`` or
  ``("init_error", rank, traceback_text)``.
* parent -> worker: ``("run", task_id, payload_bytes)`` where the payload unpickles
  to a :class:`Task`.
* worker -> parent: ``("ok", task_id, result_bytes, clean)`` or
  ``("error", task_id, failure_fields, clean)``; ``clean`` is False when the call
  left the process group unusable (destroyed it, for one).
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from remat_dist._state import reset_process_state
from remat_dist.testing._context import DistContext, _set_current

__all__ = ["FnRef", "Task", "worker_main", "STACK_SIGNAL"]

STACK_SIGNAL = getattr(signal, "SIGUSR1", None)
"""Signal on which a worker dumps every thread's Python stack to its stack file."""


@dataclass(frozen=True)
class FnRef:
    """A function named by module and qualified name, imported on the rank.

    ``file`` is the module's source path, used when the module cannot be imported
    by name on the rank (pytest's ``importlib`` import mode, for instance).
    ``method``: call on a fresh instance of the owning class. ``wants_ctx``: pass the
    :class:`DistContext` as the first (non-self) argument.
    """

    module: str
    qualname: str
    file: str | None = None
    method: bool = False
    wants_ctx: bool = False


@dataclass
class Task:
    """One call: what to run, with what, on which mesh."""

    fn: Any  # FnRef or a picklable callable
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    mesh_shape: tuple[int, ...] | None = None
    mesh_dim_names: tuple[str, ...] | None = None
    shared_dir: str = ""
    test_name: str = ""


def _import_module(name: str, file: str | None) -> Any:
    if name == "__main__":
        # The caller's script: ours is another program (or the fork server's).
        main = sys.modules.get("__main__")
        if file and getattr(main, "__file__", None) == file:
            return main
        name = "__remat_dist_main__"  # loaded from file, so its main guard is off
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        if not file:
            raise
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"cannot import {name!r} from {file!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _unwrap(obj: Any) -> Any:
    """Find the test body behind ``@distributed`` (and decorators stacked on it)."""
    seen = 0
    cur = obj
    while cur is not None and seen < 32:
        body = getattr(cur, "_remat_dist_body", None)
        if body is not None:
            return body
        cur = getattr(cur, "__wrapped__", None)
        seen += 1
    return obj


def _resolve(ref: FnRef) -> tuple[Any, Any | None]:
    """(function, owner class or None) named by ``ref``."""
    module = _import_module(ref.module, ref.file)
    parts = ref.qualname.split(".")
    owner: Any = None
    obj: Any = module
    for part in parts:
        owner = obj
        obj = getattr(obj, part)
    return _unwrap(obj), (owner if ref.method else None)


class _Worker:
    def __init__(self, rank: int, world_size: int) -> None:
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        self.rank = rank
        self.world_size = world_size
        self.meshes: dict[tuple[Any, ...], Any] = {}
        self.world = dist.group.WORLD
        self.defaults = (
            torch.get_default_dtype(),
            torch.is_grad_enabled(),
            (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
        )

    def mesh(self, shape: tuple[int, ...], names: tuple[str, ...] | None) -> Any:
        key = (shape, names)
        mesh = self.meshes.get(key)
        if mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            self.meshes[key] = mesh
        return mesh

    def reset(self) -> None:
        torch = self.torch
        dtype, grad, deterministic = self.defaults
        if torch.get_default_dtype() != dtype:
            torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        now = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        if now != deterministic:  # the setter's first call costs a second: skip it
            torch.use_deterministic_algorithms(
                deterministic[0], warn_only=deterministic[1]
            )
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)

    def clean(self) -> bool:
        dist = self.dist
        return dist.is_initialized() and dist.group.WORLD is self.world

    def run(self, task: Task) -> Any:
        mesh = None
        if task.mesh_shape is not None:
            mesh = self.mesh(task.mesh_shape, task.mesh_dim_names)
        ctx = DistContext(
            rank=self.rank,
            world_size=self.world_size,
            mesh=mesh,
            shared_dir=task.shared_dir,
            test_name=task.test_name,
        )
        fn = task.fn
        args: list[Any] = list(task.args)
        if isinstance(fn, FnRef):
            ref = fn
            fn, owner = _resolve(ref)
            if ref.wants_ctx:
                args.insert(0, ctx)
            if owner is not None:
                args.insert(0, owner())
        # every call starts from reset process state, as every pytest test does
        # (a counting pair a budget left on the stack, caches, hooks)
        reset_process_state()
        if task.shared_dir:
            from remat_dist.distributed import reset_step_state

            reset_step_state(task.shared_dir)  # the same on every rank of the call
        _set_current(ctx)
        try:
            return fn(*args, **task.kwargs)
        finally:
            _set_current(None)


def _failure_fields(rank: int, exc: BaseException) -> dict[str, Any]:
    frames = exc.__traceback__
    # Start the traceback at the user's function, not in this loop.
    while frames is not None and frames.tb_frame.f_code.co_filename == __file__:
        frames = frames.tb_next
    tb = "".join(
        traceback.format_exception(type(exc), exc, frames or exc.__traceback__)
    )
    try:
        exc_bytes: bytes | None = pickle.dumps(exc)
    except Exception:
        exc_bytes = None
    cls = type(exc)
    exc_type = f"{cls.__module__}.{cls.__qualname__}"
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is not None:
        # pytest's outcome classes claim to live in builtins (so neither their
        # names nor pickles are usable): name them by what they are.
        for name in ("Skipped", "XFailed", "Failed"):
            kind = getattr(outcomes, name, None)
            if isinstance(kind, type) and isinstance(exc, kind):
                exc_type = f"_pytest.outcomes.{name}"
                break
    return {
        "rank": rank,
        "exc_type": exc_type,
        "message": str(exc),
        "traceback": tb,
        "exception_bytes": exc_bytes,
    }


def _redirect(path: str, fd: int) -> None:
    new = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(new, fd)
    os.close(new)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


def _watch_parent(alive: Any) -> None:
    """Exit at once when the parent goes away, even if the main thread is blocked
    in a collective (the parent holds the other end of ``alive`` and never writes)."""
    from multiprocessing.connection import wait

    def watch() -> None:
        wait([alive])
        os._exit(70)

    threading.Thread(target=watch, name="remat_dist-parent-watch", daemon=True).start()


def worker_main(
    rank: int,
    world_size: int,
    store_path: str,
    conn: Any,
    alive: Any,
    out_path: str,
    err_path: str,
    stack_path: str,
    pg_timeout_s: float,
    env: dict[str, str],
) -> None:
    """Entry point of one rank's process (the ``multiprocessing`` target)."""
    _redirect(out_path, 1)
    _redirect(err_path, 2)
    # Ctrl-C reaches the whole process group; the parent handles it and kills us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stack_file = open(stack_path, "w")  # kept open for the life of the process
    if STACK_SIGNAL is not None:
        faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True)
    _watch_parent(alive)
    os.environ.update(env)

    t0 = time.perf_counter()
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        worker = _Worker(rank, world_size)
    except BaseException:
        _flush()
        conn.send_bytes(pickle.dumps(("init_error", rank, traceback.format_exc())))
        return
    conn.send_bytes(
        pickle.dumps(("ready", rank, os.getpid(), time.perf_counter() - t0))
    )

    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            break
        kind, task_id, payload = pickle.loads(raw)
        if kind != "run":
            break
        try:
            task = pickle.loads(payload)
            result = worker.run(task)
            try:
                reply: tuple[Any, ...] = ("ok", task_id, pickle.dumps(result))
            except Exception as exc:
                raise TypeError(
                    f"the return value of rank {rank} ({type(result).__name__}) "
                    f"cannot be pickled to send to the parent: {exc}"
                ) from exc
        except BaseException as exc:  # noqa: B036 - report everything, even exits
            reply = ("error", task_id, _failure_fields(rank, exc))
        finally:
            _flush()
        clean = worker.clean()
        try:
            worker.reset()
        except Exception:
            clean = False
        conn.send_bytes(pickle.dumps((*reply, clean)))
        if not clean:
            break
    _flush()
