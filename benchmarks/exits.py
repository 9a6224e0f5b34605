"""``python -m benchmarks.exits N``: how jobs end. Runs an ordinary user
script N times on 2 local ranks and counts the runs in which a rank did not exit
cleanly.

The script (``python -m benchmarks.exits --worker``) is what a user
writes: ``init_process_group`` from the environment, the reference GPT with
``apply_remat`` and tensor parallelism (so every step runs an agreement and a
report), a few optimizer steps, ``destroy_process_group()``, and it falls off the
end: no final barrier, no ``os._exit``. The ranks are plain processes with
``MASTER_ADDR``/``MASTER_PORT``, so rank 0 hosts the store (as under
``mp.spawn``; torchrun's agent hosts it elsewhere): the case where a rank that
finishes first takes the store away from one still in its last backward.

Per run it records each rank's exit code and whether its stderr holds
"terminate called" or "exception not rethrown" (the two C++ aborts at exit) or
a ``DistNetworkError`` / connection error raised out of ``loss.backward()``.

``--layout forced`` runs instead the timing that makes the rare abort at exit
certain: rank 0 issues an asynchronous all-reduce inside a checkpoint's extent
(with saved-tensor hooks on the thread, as a checkpoint's forward has them) and
falls off the end while its peer joins that collective late, so gloo's worker
thread completes it during rank 0's interpreter shutdown; a C-level ``atexit``
callback holds the GIL for a moment to make the straddle deterministic. Before
``remat_dist.distributed._intercept._issue_bare`` the work captured the hooks
(Python objects) and its thread took the GIL to free them: "terminate called
without an active exception" in most runs. ``--layout forced-hooks`` issues the
all-reduce under ``remat_dist.saved_tensors_hooks`` outside any checkpoint (an
offloader or ``SavedBytesCounter`` around a forward), ``--layout forced-torch``
under torch's own ``saved_tensors_hooks``, which remat_dist does not see: the
control, where the abort is torch's.

``--layout cycle`` runs a script whose process groups outlive
``destroy_process_group()`` in a reference cycle only, as a model built inside
``main()`` holds its groups once ``main()`` returns: Python frees the cycle during
finalization, where a gloo group's destructor aborts the process, unless
something collects it first (``remat_dist.distributed._exit`` does, at exit).
``--checkpoint torch`` takes that exit handler away: the control.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks._torchrun import child_env

__all__ = ["main", "run_exits"]

_MARKERS = {
    "terminate": "terminate called",
    "not_rethrown": "exception not rethrown",
    "network": "DistNetworkError",
    "connection": "Connection reset",
    "broken_pipe": "Broken pipe",
}


def _worker(layout: str, steps: int, checkpoint: str = "remat") -> None:
    """One rank of the ordinary script; ``checkpoint="torch"`` puts
    ``torch.utils.checkpoint`` in each block instead of remat_dist (the baseline:
    the same script without remat_dist)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import remat_dist as remat
    from remat_dist.models import GPT, Block, GPTConfig, make_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    config = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=2)
    model = GPT(config)
    if checkpoint == "torch":
        import torch.utils.checkpoint as tuc

        from benchmarks.dist import _torch_checkpoint_blocks

        _torch_checkpoint_blocks(model, tuc)
    else:
        remat.apply_remat(model, blocks=Block, policy="full")
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        remat.shard_model(model, mesh, blocks=Block, tp_plan=remat.shard.reference_tp_plan())
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        remat.shard_model(model, mesh, blocks=Block)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seed = dist.get_rank() if layout == "fsdp" else 0
    for step in range(steps):
        tokens, targets = make_batch(config, 4, seed=100 * step + seed)
        model.loss(tokens, targets).backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


def _worker_forced(layout: str) -> None:
    """One rank of the forced-timing run (see the module docstring)."""
    import atexit
    import contextlib
    import ctypes

    atexit.register(sum, range(30_000_000))  # registered first: runs last, holds the GIL

    import torch
    import torch.distributed as dist

    import remat_dist as remat
    from remat_dist.distributed._collectives import observe_collectives

    class PassThrough:
        def on_collective(self, call: Any, issue: Any) -> Any:
            return issue()

    def identity(x: Any) -> Any:
        return x

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1 << 16)
    dist.barrier()
    if rank == 1:
        time.sleep(0.3)  # rank 0 is in its interpreter shutdown by then
    with contextlib.ExitStack() as extent:
        if layout == "forced":  # a checkpoint's extent: torch's hooks, observed
            extent.enter_context(torch.autograd.graph.saved_tensors_hooks(identity, identity))
            extent.enter_context(observe_collectives(PassThrough()))
        elif layout == "forced-hooks":  # the user's remat_dist hooks, no checkpoint
            extent.enter_context(remat.saved_tensors_hooks(identity, identity))
        else:  # "forced-torch": torch's own hooks, which remat_dist does not see
            extent.enter_context(torch.autograd.graph.saved_tensors_hooks(identity, identity))
        work = dist.all_reduce(t, async_op=True)
    if rank == 1:
        work.wait()
    for obj in (t, work):  # never freed: only the work's thread state can need the GIL
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _worker_cycle(checkpoint: str) -> None:
    """One rank of the ``cycle`` layout (see the module docstring)."""
    import atexit

    import torch
    import torch.distributed as dist

    # importing remat_dist installs its exit handler (as the user's script does;
    # under remat_dist/cli the worker's own package import did it)
    import remat_dist  # noqa: F401

    if checkpoint == "torch":  # the control: without remat_dist's exit handler
        from remat_dist.distributed import _exit

        atexit.unregister(_exit._at_exit)
    dist.init_process_group("gloo")

    class Trainer:
        """Holds the groups and itself, as a module and its FSDP2 state do."""

    trainer = Trainer()
    trainer.self, trainer.world = trainer, dist.group.WORLD
    trainer.group = dist.new_group([0, 1])
    for _ in range(3):
        dist.all_reduce(torch.ones(1000), group=trainer.group)
        dist.all_reduce(torch.ones(1000))
    del trainer
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_run(layout: str, steps: int, timeout: float, checkpoint: str) -> dict[str, Any]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = child_env(
            RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONWARNINGS="ignore",
        )
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "benchmarks.exits", "--worker",
             "--layout", layout, "--steps", str(steps), "--checkpoint", checkpoint],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        ))
    ranks = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err += "\n(timed out)"
        ranks.append({
            "returncode": p.returncode,
            **{k: m in err for k, m in _MARKERS.items()},
            "stderr_tail": err[-1500:] if p.returncode else "",
        })
    return {"ranks": ranks, "ok": all(r["returncode"] == 0 for r in ranks)}


def run_exits(runs: int, *, layout: str = "tp", steps: int = 3, parallel: int = 2,
              timeout: float = 120.0, checkpoint: str = "remat") -> dict[str, Any]:
    """``runs`` two-rank runs of the script; counts per failure kind."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(parallel) as pool:
        results = list(pool.map(
            lambda _: _one_run(layout, steps, timeout, checkpoint), range(runs)
        ))
    exits = [r for res in results for r in res["ranks"]]
    return {
        "layout": layout,
        "checkpoint": checkpoint,
        "runs": runs,
        "worker_exits": len(exits),
        "failed_runs": sum(not res["ok"] for res in results),
        "nonzero_exits": sum(r["returncode"] != 0 for r in exits),
        **{f"{k}_exits": sum(r[k] for r in exits) for k in _MARKERS},
        "seconds": time.monotonic() - t0,
        "failures": [res for res in results if not res["ok"]][:5],
    }


def format_exits(result: dict[str, Any]) -> str:
    keys = ["runs", "worker_exits", "failed_runs", "nonzero_exits",
            *(f"{k}_exits" for k in _MARKERS)]
    head = f"{'layout':<7} {'checkpoint':<10}" + "".join(f" {k:>16}" for k in keys)
    row = f"{result['layout']:<7} {result.get('checkpoint', 'remat'):<10}" + "".join(
        f" {result[k]:>16}" for k in keys
    )
    return f"{head}\n{row}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.exits",
        description="Run an ordinary 2-rank script N times; count unclean exits.",
    )
    parser.add_argument("runs", type=int, nargs="?", default=50)
    parser.add_argument(
        "--layout",
        choices=("tp", "fsdp", "forced", "forced-hooks", "forced-torch", "cycle"),
        default="tp",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--checkpoint", choices=("remat", "torch"), default="remat",
        help="the blocks' checkpoint: remat_dist's, or torch.utils.checkpoint (baseline)",
    )
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        if args.layout.startswith("forced"):
            _worker_forced(args.layout)
        elif args.layout == "cycle":
            _worker_cycle(args.checkpoint)
        else:
            _worker(args.layout, args.steps, args.checkpoint)
        return 0
    result = run_exits(
        args.runs, layout=args.layout, steps=args.steps, parallel=args.parallel,
        checkpoint=args.checkpoint,
    )
    print(format_exits(result))
    for failure in result["failures"]:
        for rank, r in enumerate(failure["ranks"]):
            if r["returncode"]:
                print(f"--- rank {rank} exit {r['returncode']}:\n{r['stderr_tail']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["failed_runs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
