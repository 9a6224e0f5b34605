"""``python -m benchmarks.dist`` (also the distributed part of ``benchmarks.core``):
communication, bytes and time on real gloo ranks, side by side, in one run.

For a tensor-parallel and an FSDP2 reference run of the GPT (same model, same data
on every rank of a replica), four variants run interleaved: no checkpointing,
``torch.utils.checkpoint`` per block, remat_dist with verified replay
(``collectives="replay"``) and remat_dist comm-free replay (``"save"``). Per
variant: collectives issued in forward and in backward by kind, the replayed ones
(backward minus no checkpointing), all-gathers in backward, saved bytes per rank,
median step time and its ratio to no checkpointing, and the ratio to
``torch.utils.checkpoint`` of wall time and of this rank's CPU time (what the rank
itself spent, blind to the other processes on a shared machine), each the median
over iterations of the ratio within one iteration (every iteration runs every
variant once, in a rotating order, so the machine's drift cancels). "saved" counts what backward
will need per rank: what the saved-tensors hooks see (checkpoint inputs, torch's
checkpoint's included) plus the collective outputs ``"save"`` keeps for comm-free
replay, shown again in their own column ("of which kept coll."). Per variant also:
the agreement rounds, gloo operations on the stakes' groups and store requests
per rank and step (``remat_dist.distributed.step_stats``): zero where nothing is
at stake. Then the ledger's own costs: per collective (record, verify), and one
step's rounds (the agreement and the report) on a 2-rank stake group
(``StakeGroup``, as ``_step`` issues them: 6 int64 each).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import Any

from benchmarks._output import write_json
from benchmarks._torchrun import run_worker

VARIANTS = ("none", "torch.utils.checkpoint", "remat replay", "remat save")


def _build(layout: str, variant: str, cfg: dict[str, Any]) -> Any:
    import torch.distributed as dist
    import torch.utils.checkpoint as tuc
    from torch.distributed.device_mesh import init_device_mesh

    import remat_dist as remat
    from remat_dist.models import GPT, Block, GPTConfig

    world = dist.get_world_size()
    config = GPTConfig(
        vocab_size=256, seq_len=cfg["seq"], dim=cfg["dim"], n_heads=4, n_layers=cfg["layers"]
    )
    model = GPT(config)
    if variant == "torch.utils.checkpoint":
        _torch_checkpoint_blocks(model, tuc)
    elif variant == "remat replay":
        remat.apply_remat(model, blocks=Block, collectives="replay")
    elif variant == "remat save":
        remat.apply_remat(model, blocks=Block, collectives="save")
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        remat.shard_model(model, mesh, blocks=Block, tp_plan=remat.shard.reference_tp_plan())
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        remat.shard_model(model, mesh, blocks=Block)
    return model, config


def _torch_checkpoint_blocks(model: Any, tuc: Any) -> None:
    """``torch.utils.checkpoint`` inside each block's forward, where ``apply_remat``
    puts remat_dist's (and torchtitan's ``checkpoint_wrapper`` then ``fully_shard``
    puts torch's): inside the FSDP unit, so both variants run the same hooks."""
    for block in model.layers:
        forward = block.forward

        def checkpointed(x: Any, forward: Any = forward) -> Any:
            return tuc.checkpoint(forward, x, use_reentrant=False)

        block.forward = checkpointed


def one_rank_fsdp2_bench(port: int) -> tuple[Any, Any]:
    """The FSDP2 overhead benchmarks' setup (``benchmarks/fsdp2_*.py``): a 1-rank
    gloo group (on ``port`` unless ``MASTER_PORT`` is set), one torch thread, and
    ``(config, build)``: ``build(variant)`` makes the reference GPT (dim 128, 4
    blocks, seq 64) sharded by FSDP2 per block, each block checkpointed inside its
    unit by remat_dist (a variant whose name starts with ``remat_dist``) or by
    ``torch.utils.checkpoint`` (any other)."""
    import os

    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(port)),
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        os.environ.setdefault(key, value)
    import torch
    import torch.distributed as dist
    import torch.utils.checkpoint as tuc
    from torch.distributed.device_mesh import init_device_mesh

    import remat_dist as remat
    from remat_dist.models import GPT, Block, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = GPTConfig(vocab_size=256, seq_len=64, dim=128, n_heads=4, n_layers=4)

    def build(variant: str) -> Any:
        torch.manual_seed(0)
        model = GPT(config)
        if variant.startswith("remat_dist"):
            remat.apply_remat(model, blocks=Block)
        else:
            _torch_checkpoint_blocks(model, tuc)
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        remat.shard_model(model, mesh, blocks=Block)
        return model

    return config, build


def _kinds(ledger: Any) -> dict[str, int]:
    return dict(Counter(e.op for e in ledger.entries))


def bench_rank(layout: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs on every rank; returns this rank's measurements."""
    import torch.distributed as dist

    from remat_dist.distributed import step_stats
    from remat_dist.distributed._collectives import (
        RecordCollectives,
        observe_collectives,
    )
    from remat_dist.models import make_batch
    from remat_dist.report import build_saved_tensors_report
    from remat_dist.testing import SavedBytesCounter

    models = {v: _build(layout, v, cfg) for v in VARIANTS}
    dp_rank = dist.get_rank() if layout == "fsdp" else 0
    out: dict[str, Any] = {}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rounds: dict[str, Counter[str]] = {v: Counter() for v in VARIANTS}
    for it in range(cfg["warmup"] + cfg["iters"]):
        for v in VARIANTS[it % len(VARIANTS):] + VARIANTS[: it % len(VARIANTS)]:
            model, config = models[v]
            tokens, targets = make_batch(config, cfg["batch"], seed=dp_rank)
            dist.barrier()
            before = step_stats()
            t0, c0 = time.perf_counter(), time.process_time()
            model.loss(tokens, targets).backward()
            elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - c0
            after = step_stats()
            model.zero_grad(set_to_none=True)
            if it >= cfg["warmup"]:
                times[v].append(elapsed)
                cpu[v].append(cpu_s)
                for k in ("agreements", "reports", "operations", "store_requests"):
                    rounds[v][k] += getattr(after, k) - getattr(before, k)
    ratios = {
        v: [a / b for a, b in zip(times[v], times["torch.utils.checkpoint"])]
        for v in VARIANTS
    }
    for v in VARIANTS:
        model, config = models[v]
        tokens, targets = make_batch(config, cfg["batch"], seed=dp_rank)
        fwd, bwd = RecordCollectives(), RecordCollectives()
        with observe_collectives(fwd), SavedBytesCounter(model.parameters()) as count:
            loss = model.loss(tokens, targets)
        # The hooks see what autograd and the checkpoints pack; collective outputs
        # kept for comm-free replay live on the checkpoint's record, which they do
        # not see: the report counts those.
        kept = build_saved_tensors_report(loss).kept_collective_bytes
        saved = count.activation_bytes + kept
        with observe_collectives(bwd):
            loss.backward()
        model.zero_grad(set_to_none=True)
        out[v] = {
            "forward": _kinds(fwd.ledger),
            "backward": _kinds(bwd.ledger),
            "saved_bytes": saved,
            "kept_collective_bytes": kept,
            "time_s": statistics.median(times[v]),
            "cpu_s": statistics.median(cpu[v]),
            # each iteration runs every variant once, in a rotating order: the
            # ratio of two variants within one iteration cancels the machine's
            # drift; the median over iterations is what the table shows
            "x_torch": statistics.median(ratios[v]),
            "x_torch_ci95": _median_ci95(ratios[v]),
            "cpu_x_torch": statistics.median(
                a / b for a, b in zip(cpu[v], cpu["torch.utils.checkpoint"])
            ),
            "per_step": {k: n / cfg["iters"] for k, n in rounds[v].items()},
        }
    out["ledger_cost_us"] = _ledger_costs(cfg["iters"] * 20)
    return out


def _ratio_row(mine: list[float], base: list[float]) -> dict[str, Any]:
    """Paired timings (seconds) of remat_dist and ``torch.utils.checkpoint``: both
    medians in ms, the median of the per-iteration ratios and its 95% interval."""
    ratios = [a / b for a, b in zip(mine, base)]
    return {
        "torch_ms": statistics.median(base) * 1e3,
        "remat_ms": statistics.median(mine) * 1e3,
        "x_torch": statistics.median(ratios),
        "x_torch_ci95": _median_ci95(ratios),
    }


def _median_ci95(values: list[float], resamples: int = 1000) -> list[float]:
    """A 95% interval of the median of ``values`` (percentile bootstrap, seeded):
    how far the ratio a run shows can be from what the machine's noise hides."""
    import random

    if len(values) < 2:
        return [values[0], values[0]] if values else [0.0, 0.0]
    rng = random.Random(0)
    meds = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    return [meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]]


def _ledger_costs(n: int) -> dict[str, float]:
    """Per-collective cost of recording and verifying, and one agreement round."""
    import torch
    import torch.distributed as dist

    from remat_dist.distributed._collectives import (
        CollectiveLedger,
        RecordCollectives,
        VerifyCollectives,
        observe_collectives,
    )

    t = torch.ones(1)

    def timed(ctx_factory: Any) -> float:
        dist.barrier()
        samples = []
        for _ in range(5):
            with ctx_factory():
                t0 = time.perf_counter()
                for _ in range(n):
                    dist.all_reduce(t)
                samples.append((time.perf_counter() - t0) / n)
        return statistics.median(samples) * 1e6

    import contextlib

    bare = timed(contextlib.nullcontext)
    record = timed(lambda: observe_collectives(RecordCollectives()))
    ledger = RecordCollectives()
    with observe_collectives(ledger):
        for _ in range(n):
            dist.all_reduce(t)

    def verify() -> Any:
        return observe_collectives(
            VerifyCollectives(CollectiveLedger(ledger.ledger.entries * 5), label="bench")
        )

    verified = timed(verify)
    logic = _logic_costs(t)
    rounds, group = _step_rounds(200)
    return {
        "all_reduce_bare": bare,
        "record_extra": record - bare,
        "verify_extra": verified - bare,
        "record_logic": logic["record"],
        "verify_logic": logic["verify"],
        "step_rounds": statistics.median(rounds) * 1e6,
        "store_requests_per_step": group["store_requests"] / 200,
        "operations_per_step": group["operations"] / 200,
    }


def _step_rounds(steps: int) -> tuple[list[float], dict[str, int]]:
    """One step's rounds, ``steps`` times, on a stake group of every rank (a new
    stake, so the set-up is done in a warm-up step outside the timings): the plan
    agreement and the end-of-backward report, each a 6-int64 max-reduce built as
    ``_step`` builds it. Seconds per step, and the group's operations and store
    requests over the timed steps."""
    import torch.distributed as dist

    from remat_dist._torch._c10d import default_store
    from remat_dist.distributed._stake_group import StakeGroup, stake_base, tagged_words

    ranks = tuple(range(dist.get_world_size()))
    names = [f"bench/{time.time_ns()}"]
    dist.broadcast_object_list(names, src=0)  # a new stake per run, the same everywhere
    group = StakeGroup(ranks, dist.get_rank(), default_store(), stake_base(names[0], ranks), 0)
    agree, report = tagged_words(1, [3, 4]), tagged_words(2, [0, 0])
    group.reduce_max(agree, 60.0)  # set-up: the gloo group's rendezvous
    group.reduce_max(report, 60.0)
    ops0, req0 = group.rounds, group.store_requests
    rounds = []
    for _ in range(steps):
        t0 = time.perf_counter()
        group.reduce_max(agree, 60.0)
        group.reduce_max(report, 60.0)
        rounds.append(time.perf_counter() - t0)
    counts = {
        "operations": group.rounds - ops0,
        "store_requests": group.store_requests - req0,
    }
    group.close()
    return rounds, counts


def _logic_costs(t: Any, n: int = 20000) -> dict[str, float]:
    """Microseconds per collective of the record and verify logic alone (a captured
    call handed to the observers with a no-op issue): the part remat_dist controls,
    without torch's boxed-kernel round trip and the collective itself."""
    import timeit

    import torch.distributed as dist

    from remat_dist.distributed._collectives import (
        CollectiveCall,
        RecordCollectives,
        VerifyCollectives,
        observe_collectives,
    )

    calls: list[Any] = []

    class _Capture:
        def on_collective(self, call: Any, issue: Any) -> Any:
            calls.append(call)
            return issue()

    with observe_collectives(_Capture()):
        dist.all_reduce(t)
    c = calls[0]

    def fresh() -> Any:
        return CollectiveCall(c._spec, c.args, c._keyset)

    rec = RecordCollectives()
    rec.on_collective(fresh(), lambda: None)
    ver = VerifyCollectives(rec.ledger.entries, label="bench")

    def record() -> None:
        rec.ledger.entries.clear()
        rec.on_collective(fresh(), lambda: None)

    def verify() -> None:
        ver.position = 0
        ver.on_collective(fresh(), lambda: None)

    out = {}
    for name, fn in (("record", record), ("verify", verify)):
        out[name] = min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6
    return out


def _torchrun_main(json_path: str, cfg: dict[str, Any]) -> None:
    """One rank of the benchmark under torchrun: both layouts; rank 0 writes JSON."""
    import json

    import torch
    import torch.distributed as dist

    from remat_dist.distributed import all_gather_objects

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        results = {}
        for layout in ("tp", "fsdp"):
            mine = bench_rank(layout, cfg)
            per_rank = all_gather_objects(mine)
            for v in VARIANTS:
                mine[v]["saved_bytes_per_rank"] = [r[v]["saved_bytes"] for r in per_rank]
                mine[v]["kept_collective_bytes_per_rank"] = [
                    r[v]["kept_collective_bytes"] for r in per_rank
                ]
            results[layout] = mine
        if dist.get_rank() == 0:
            with open(json_path, "w") as f:
                json.dump({"world_size": dist.get_world_size(), "config": cfg, "layouts": results}, f)
    finally:
        dist.destroy_process_group()


def run_distributed_bench(world_size: int = 2, **cfg: Any) -> dict[str, Any]:
    """Both layouts on ``world_size`` local CPU ranks started by ``torchrun``
    (its TCPStore, as in real jobs); rank 0's measurements plus every rank's saved
    bytes."""
    defaults = {"seq": 64, "dim": 128, "layers": 4, "batch": 4, "iters": 8, "warmup": 2}
    defaults.update(cfg)
    return run_worker("benchmarks.dist", world_size, defaults, "distributed benchmark")


def _per(row: dict[str, Any], key: str) -> float:
    return float(row.get("per_step", {}).get(key, 0.0))


def format_dist_table(result: dict[str, Any]) -> str:
    lines = []
    head = (
        f"{'layout':<6} {'variant':<24} {'fwd coll':>8} {'bwd coll':>8} {'replayed':>8} "
        f"{'bwd all-gathers':>15} {'saved KiB/rank':>16} {'of which kept coll.':>19} "
        f"{'time ms':>8} {'x none':>6} {'x torch':>7} {'cpu x torch':>11} {'rounds/step':>11} "
        f"{'gloo ops/step':>13} {'store req/step':>14}"
    )
    lines += [head, "-" * len(head)]
    for layout, res in result["layouts"].items():
        base_bwd = sum(res["none"]["backward"].values())
        base_t = res["none"]["time_s"]
        torch_t = res["torch.utils.checkpoint"]["time_s"]
        torch_c = res["torch.utils.checkpoint"].get("cpu_s") or 1.0
        for v in VARIANTS:
            r = res[v]
            bwd = sum(r["backward"].values())
            gathers = sum(n for op, n in r["backward"].items() if "allgather" in op)
            saved = "/".join(f"{b / 1024:.0f}" for b in r["saved_bytes_per_rank"])
            kept = "/".join(
                f"{b / 1024:.0f}" for b in r.get("kept_collective_bytes_per_rank", [0])
            )
            lines.append(
                f"{layout:<6} {v:<24} {sum(r['forward'].values()):>8} {bwd:>8} "
                f"{bwd - base_bwd:>8} {gathers:>15} {saved:>16} {kept:>19} "
                f"{r['time_s'] * 1e3:>8.1f} {r['time_s'] / base_t:>6.3f} "
                f"{r.get('x_torch', r['time_s'] / torch_t):>7.3f} "
                f"{r.get('cpu_x_torch', r.get('cpu_s', 0.0) / torch_c):>11.3f} "
                f"{_per(r, 'agreements') + _per(r, 'reports'):>11.1f} "
                f"{_per(r, 'operations'):>13.1f} {_per(r, 'store_requests'):>14.1f}"
            )
    costs = result["layouts"]["tp"]["ledger_cost_us"]
    lines.append(
        f"\nledger cost (rank 0, 1-float all_reduce {costs['all_reduce_bare']:.0f} us bare): "
        f"record +{costs['record_extra']:.0f} us, verify +{costs['verify_extra']:.0f} us per "
        f"collective (of which remat_dist's logic: record {costs['record_logic']:.1f} us, "
        f"verify {costs['verify_logic']:.1f} us); one step's agreement + report on a "
        f"2-rank stake group {costs['step_rounds']:.0f} us, "
        f"{costs['operations_per_step']:.0f} gloo operations and "
        f"{costs['store_requests_per_step']:.0f} store requests per rank "
        "(any number of checkpoints)"
    )
    ci = [
        f"{layout} {v}: [{r['x_torch_ci95'][0]:.3f}, {r['x_torch_ci95'][1]:.3f}]"
        for layout, res in result["layouts"].items()
        for v in VARIANTS[2:]
        if "x_torch_ci95" in (r := res[v])
    ]
    if ci:
        lines.append("x torch, 95% interval of the median: " + "; ".join(ci))
    kinds = result["layouts"]["tp"]["remat replay"]["backward"]
    lines.append(f"tp backward collectives by kind (remat replay): {kinds}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run both layouts on ``--ranks`` torchrun ranks; print the table, write
    ``--json``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.dist", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=8, help="measured iterations")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    result = run_distributed_bench(args.ranks, iters=args.iters)
    print(format_dist_table(result))
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    import sys

    from benchmarks._torchrun import rank_args

    if (rank := rank_args(sys.argv[1:])) is not None:
        _torchrun_main(*rank)
    else:
        raise SystemExit(main())
