"""remat_dist's verified replay against ``torch.utils.checkpoint`` under tensor
parallelism, resolved to a fraction of a percent.

Under TP every replay re-issues the forward's collectives: remat_dist records them
in forward, agrees on the plan among the TP group, verifies each one before it is
issued on replay and reports at backward's end. The 2-rank ``benchmarks.dist`` rows
cannot resolve a 5% target on a shared 2-core box (their intervals are 8-13
points wide). This script runs the same model and layout (the reference GPT, dim
128, 4 blocks, seq 64, batch 4, the reference TP plan on 2 gloo ranks it starts
itself), five variants interleaved over many iterations in a rotating order (no
checkpointing, ``torch.utils.checkpoint`` per block, remat_dist per block with
``collectives="replay"``, ``torch.utils.checkpoint`` with two plain gloo
``all_reduce`` of 6 int64 per step where remat_dist runs its two rounds: the
control that says what two small gloo round trips cost this step on torch's own
API, and ``torch.utils.checkpoint`` with every collective passed through
remat_dist's Python kernel doing nothing: the floor of seeing collectives from
Python), and reports per step:

* ``cpu``: the CPU time of both ranks together (what the checking costs, without
  the peers' jitter: a rank waiting on gloo sleeps);
* ``wall``: the slower rank's wall time, what a user waits for.

Each as ratios within one iteration, remat_dist over torch's (``x_torch``, the
target), each checkpointing variant over no checkpointing (``x_none``), and
remat_dist and the interception floor over the control (``x_control``), with
the median over iterations and its seeded bootstrap 95% interval, and the
collectives each variant issues per step; it writes JSON. remat_dist's rounds
(one agreement and one report per step) run on the TP group's stake group; the
script also gives how long they held each rank's backward per step
(``StepStats.agreement_wait_s`` and ``report_wait_s``: the agreement is posted
when the first replay starts and finished before the first collective) and, on
Linux, each variant's CPU time per step by thread: the main thread, gloo's
threads (its I/O loops and worker), the rest; every gloo operation, torch's
collectives and remat_dist's rounds alike, costs CPU time on gloo's threads.

    python -m benchmarks.tp_overhead [--iters N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks._torchrun import child_env

VARIANTS = (
    "none", "torch.utils.checkpoint", "remat replay", "torch + 2 gloo rounds",
    "torch + interception",
)
ROUNDS = "torch + 2 gloo rounds"
"""``torch.utils.checkpoint`` plus what remat_dist's two rounds would be on torch's
own API: a ``dist.all_reduce`` (MAX) of 6 int64 on a gloo group of the same
ranks when backward starts (a hook on the loss) and one after it: what two
small gloo collectives cost this step, the control for remat_dist's rounds."""
INTERCEPTED = "torch + interception"
"""``torch.utils.checkpoint`` with every collective of the step passed through
remat_dist's Python dispatcher kernel, which does nothing with it: what seeing
each collective from Python costs by itself (torch boxing the call's arguments
for Python and back), the floor under recording and verifying them."""


def _thread_cpu() -> dict[str, float]:
    """This process's CPU seconds so far by kind of thread (Linux; else empty):
    ``main``, ``gloo`` (gloo's I/O loops and worker threads), ``other``."""
    out = {"main": 0.0, "gloo": 0.0, "other": 0.0}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                seconds = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
        kind = (
            "main" if int(tid) == os.getpid()
            else "gloo" if "gloo" in name else "other"
        )
        out[kind] += seconds
    return out


def _rank_main(out_path: str, iters: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.utils.checkpoint as tuc
    from torch.distributed.device_mesh import init_device_mesh

    import remat_dist as remat
    from benchmarks.dist import _torch_checkpoint_blocks
    from remat_dist.distributed import all_gather_objects
    from remat_dist.distributed._collectives import (
        RecordCollectives,
        observe_collectives,
    )
    from remat_dist.distributed._intercept import set_step_hooks
    from remat_dist.models import GPT, Block, GPTConfig, make_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = GPTConfig(vocab_size=256, seq_len=64, dim=128, n_heads=4, n_layers=4)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))

    def build(variant: str) -> Any:
        torch.manual_seed(0)
        model = GPT(config)
        if variant == "remat replay":
            remat.apply_remat(model, blocks=Block, collectives="replay")
        elif variant in ("torch.utils.checkpoint", ROUNDS, INTERCEPTED):
            _torch_checkpoint_blocks(model, tuc)
        remat.shard_model(model, mesh, blocks=Block, tp_plan=remat.shard.reference_tp_plan())
        return model

    rounds_group = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    words = torch.zeros(6, dtype=torch.int64)

    def gloo_round() -> None:
        dist.all_reduce(words, op=dist.ReduceOp.MAX, group=rounds_group)

    def step(v: str) -> None:
        if v == INTERCEPTED:
            set_step_hooks(lambda: None, lambda ranks: None)
        loss = models[v].loss(tokens, targets)
        if v == ROUNDS:
            loss.register_hook(lambda g: (gloo_round(), g)[1])
        loss.backward()
        if v == ROUNDS:
            gloo_round()
        if v == INTERCEPTED:
            set_step_hooks(None, None)

    try:
        models = {v: build(v) for v in VARIANTS}
        tokens, targets = make_batch(config, 4, seed=0)
        wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
        cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
        waits: dict[str, list[float]] = {"agreement": [], "report": []}
        threads: dict[str, dict[str, float]] = {v: {} for v in VARIANTS}
        for it in range(20 + iters):
            k = it % len(VARIANTS)
            for v in VARIANTS[k:] + VARIANTS[:k]:
                model = models[v]
                dist.barrier()
                before, by_thread = remat.distributed.step_stats(), _thread_cpu()
                t0, c0 = time.perf_counter(), time.process_time()
                step(v)
                elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - c0
                after, by_thread_after = remat.distributed.step_stats(), _thread_cpu()
                model.zero_grad(set_to_none=True)
                if it >= 20:
                    for kind, seconds in by_thread_after.items():
                        threads[v][kind] = (
                            threads[v].get(kind, 0.0) + seconds - by_thread[kind]
                        )
                    wall[v].append(elapsed)
                    cpu[v].append(cpu_s)
                    if v == "remat replay":
                        waits["agreement"].append(
                            after.agreement_wait_s - before.agreement_wait_s
                        )
                        waits["report"].append(after.report_wait_s - before.report_wait_s)
        counts = {}
        for v in VARIANTS:
            forward, backward = RecordCollectives(), RecordCollectives()
            with observe_collectives(forward):
                loss = models[v].loss(tokens, targets)
            with observe_collectives(backward):
                loss.backward()
            models[v].zero_grad(set_to_none=True)
            counts[v] = {"forward": len(forward.ledger), "backward": len(backward.ledger)}
        per_rank = all_gather_objects(
            {"wall": wall, "cpu": cpu, "waits": waits, "threads": threads}
        )
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump({"ranks": per_rank, "collectives_per_step": counts}, f)
    finally:
        dist.destroy_process_group()


def _launch(iters: int, ranks: int = 2) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        procs = []
        for rank in range(ranks):
            env = child_env(
                RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.tp_overhead", "--rank-of", path,
                 "--iters", str(iters)],
                env=env, stderr=subprocess.PIPE, text=True,
            ))
        errors = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError("a rank failed:\n" + "\n".join(e[-3000:] for e in errors))
        with open(path) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--json", default=None)
    parser.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of is not None:
        _rank_main(args.rank_of, args.iters)
        return
    from benchmarks.dist import _median_ci95, _ratio_row

    raw = _launch(args.iters)
    ranks = raw["ranks"]
    none, base, mine, control, intercepted = VARIANTS
    per_step = {
        # both ranks' CPU time per iteration; the slower rank's wall time
        "cpu": {v: [sum(r["cpu"][v][i] for r in ranks) for i in range(args.iters)]
                for v in VARIANTS},
        "wall": {v: [max(r["wall"][v][i] for r in ranks) for i in range(args.iters)]
                 for v in VARIANTS},
    }
    out: dict[str, Any] = {
        "iters": args.iters, "world_size": len(ranks),
        "collectives_per_step": raw["collectives_per_step"], "rows": {}, "x_none": {},
    }
    print("collectives per step (forward, backward): " + ", ".join(
        f"{v} {c['forward']}, {c['backward']}" for v, c in raw["collectives_per_step"].items()
    ))
    print(
        f"{'measure':8s} {'none ms':>8s} {'torch ms':>9s} {'remat ms':>9s}"
        f" {'remat x torch [95%]':>26s} {'torch x none [95%]':>26s}"
        f" {'remat x none [95%]':>26s} {'torch+2 rounds x torch':>26s}"
    )
    for measure, series in per_step.items():
        row = out["rows"][measure] = _ratio_row(series[mine], series[base])
        cells = [(row["x_torch"], row["x_torch_ci95"])]
        out["x_none"][measure] = {"none_ms": statistics.median(series[none]) * 1e3}
        for v in (base, mine):
            ratios = [a / b for a, b in zip(series[v], series[none])]
            ratio = {"median": statistics.median(ratios), "ci95": _median_ci95(ratios)}
            out["x_none"][measure][v] = ratio
            cells.append((ratio["median"], ratio["ci95"]))
        ratios = [a / b for a, b in zip(series[control], series[base])]
        out["rows"][measure]["control_x_torch"] = statistics.median(ratios)
        out["rows"][measure]["control_x_torch_ci95"] = _median_ci95(ratios)
        cells.append((statistics.median(ratios), _median_ci95(ratios)))
        print(
            f"{measure:8s} {out['x_none'][measure]['none_ms']:8.2f} "
            f"{row['torch_ms']:9.2f} {row['remat_ms']:9.2f}"
            + "".join(f" {m:8.4f} [{lo:.4f}, {hi:.4f}]" for m, (lo, hi) in cells)
        )
    out["x_control"] = {}
    print("over the control (torch + 2 gloo rounds), median [95%]:")
    for measure, series in per_step.items():
        cells = {}
        for v in (mine, intercepted):
            ratios = [a / b for a, b in zip(series[v], series[control])]
            cells[v] = {"median": statistics.median(ratios), "ci95": _median_ci95(ratios)}
        out["x_control"][measure] = cells
        print(f"  {measure:6s} " + "  ".join(
            f"{v} {c['median']:.4f} [{c['ci95'][0]:.4f}, {c['ci95'][1]:.4f}]"
            for v, c in cells.items()))
    if ranks[0]["threads"][none]:
        out["thread_cpu_ms_per_step"] = {}
        print("CPU ms per step and rank, by thread (mean of the ranks):")
        for v in VARIANTS:
            row = {
                kind: sum(r["threads"][v][kind] for r in ranks) / len(ranks)
                / args.iters * 1e3
                for kind in ranks[0]["threads"][v]
            }
            out["thread_cpu_ms_per_step"][v] = row
            print(f"  {v:24s} " + "  ".join(f"{k} {ms:7.2f}" for k, ms in row.items()))
    out["remat_waits_ms"] = {}
    for kind in ("agreement", "report"):
        cells = []
        for r, rank in enumerate(ranks):
            w = sorted(rank["waits"][kind])
            row = {
                "mean": statistics.mean(w) * 1e3,
                "median": statistics.median(w) * 1e3,
                "p90": w[int(0.9 * (len(w) - 1))] * 1e3,
            }
            out["remat_waits_ms"].setdefault(kind, []).append(row)
            cells.append(
                f"rank {r} mean {row['mean']:.3f} median {row['median']:.3f} "
                f"p90 {row['p90']:.3f}"
            )
        print(f"remat_dist's {kind} held backward, ms per step: " + "; ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
