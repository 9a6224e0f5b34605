"""MemoryBudget under pipeline parallelism: a plan per stage against one uniform plan.

Two pipeline stages on two gloo processes (CPU), each a slice of the reference GPT
(4 blocks per stage by default), 4 micro-batches per step, for each schedule
(``Schedule1F1B``, ``ScheduleGPipe``) and budget. Per variant and rank:

* ``peak``: the most bytes saved for backward alive at once over a whole step
  on that rank, the schedule's ``loss_fn`` included (unique storages, parameters
  apart, followed until autograd frees them), the maximum over the timed steps;
* ``fwd``: the same peak counting only what the stage modules' forwards saved
  (the loss left out);
* ``recompute_ms``: recompute time per step as the planner measured it (the
  plan's recompute time per forward x micro-batches);
* ``step_ms``: the median wall time of a schedule step (the slower rank's).

``ScheduleInterleaved1F1B`` runs 4 virtual stages, 2 per rank (half of
``--layers`` blocks each: stages ``r`` and ``r + 2`` on rank ``r``), and so do
the V-shaped ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (stages ``r``
and ``3 - r``: rank 0 holds the first stage and the last, with the loss); for
these it compares ``shared`` (one ``MemoryBudget`` object
per rank given to both of its stage modules: one budget for the rank, planned
jointly against the concurrent peak the profiling step showed) with ``sum``
(the same, planned against the sum of the two modules' own peaks, every module
at its peak at once) and ``split`` (two objects of half the budget each).
``bound`` is what each rank's plan predicts (its ``rank_peak_bytes``). The
table's ``bnd|fwd`` columns show ``bound`` on the rows of two stage modules per
rank and ``fwd`` on the others (the JSON has ``fwd`` for both).

Variants: ``none`` (no checkpoint), ``full`` (full recompute), ``per-stage``
(``MemoryBudget(bytes=B)`` on each stage: each plans for the forwards its schedule
keeps alive) and ``uniform`` (the one plan, the same decision for the i-th block
of every stage, of least summed recompute time whose peak fits ``B`` on every
stage, priced on the per-stage planners' own measurements and installed as a
fixed policy). The budgets lie between the worst rank's peak at full recompute
and no checkpoint's (``--fractions``). ``imbalance`` is max/mean of the ranks'
peaks.

    python benchmarks/budget_pipeline.py --json budget_pipeline.json

Prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import remat_dist as remat  # noqa: E402
from remat_dist.distributed import all_gather_objects  # noqa: E402
from remat_dist.models import GPT, Block, GPTConfig, GPTStage, make_batch  # noqa: E402
from remat_dist.testing import PeakSavedBytes  # noqa: E402


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _run(args, rank, schedule_name, policy, config):
    """Build this rank's stage under ``policy``, run warm-up + timed steps: peak,
    median step time, the stage module."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as sch

    per = args.layers
    torch.manual_seed(0)
    module = GPTStage(
        GPT(config), list(range(rank * per, (rank + 1) * per)), first=rank == 0, last=rank == 1
    )
    if policy is not None:
        remat.apply_remat(module, blocks=Block, policy=policy)
    meter = PeakSavedBytes(module, whole_step=True)
    pipe = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = getattr(sch, schedule_name)(pipe, n_microbatches=args.micro, loss_fn=_loss)
    peak, step_s = _time_steps(args, rank, config, schedule, [module], meter)
    return peak, step_s, module


_FWD: list[int] = []
"""The last run's forward-only peak (the loss left out), for the rows."""


V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
"""Schedules that put stages ``r`` and ``3 - r`` of 4 on rank ``r`` (a V)."""
MULTI = ("ScheduleInterleaved1F1B", *V_SHAPED)
"""Schedules with two stage modules per rank."""


def _run_multi(args, rank, schedule_name, policies, config):
    """Two stage modules per rank: virtual stages ``rank`` and ``rank + 2`` of 4
    (ScheduleInterleaved1F1B) or ``rank`` and ``3 - rank`` (the V-shaped
    schedules), half of ``--layers`` blocks each; ``policies[k]`` on the k-th
    (the same object twice: one budget for the rank). The rank's peak (both
    modules counted together), median step time, the two modules."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as sch

    per = max(1, args.layers // 2)
    order = (rank, 3 - rank) if schedule_name in V_SHAPED else (rank, rank + 2)
    mods, stages = [], []
    for k, s in enumerate(order):
        torch.manual_seed(0)
        m = GPTStage(GPT(config), list(range(s * per, (s + 1) * per)), first=s == 0, last=s == 3)
        if policies[k] is not None:
            remat.apply_remat(m, blocks=Block, policy=policies[k])
        mods.append(m)
        stages.append(PipelineStage(m, s, 4, torch.device("cpu")))
    meter = PeakSavedBytes(*mods, whole_step=True)
    schedule = getattr(sch, schedule_name)(stages, n_microbatches=args.micro, loss_fn=_loss)
    peak, step_s = _time_steps(args, rank, config, schedule, mods, meter,
                               first=0 in order, last=3 in order)
    return peak, step_s, mods


def _time_steps(args, rank, config, schedule, mods, meter, first=None, last=None):
    """Run ``--warmup`` then ``--iters`` schedule steps: the rank's peak over the
    timed steps (the first step's where none is timed; the profiling step is left
    out) and the median step time. ``first`` / ``last``: this rank holds the
    first / last stage (by default rank 0 / rank 1)."""
    first = rank == 0 if first is None else first
    last = rank == 1 if last is None else last
    tokens, targets = make_batch(config, args.micro * args.micro_batch, seed=0)
    times, peaks, fwd = [], [], []
    for step in range(args.warmup + args.iters):
        for m in mods:
            m.zero_grad(set_to_none=True)
        meter.reset()
        dist.barrier()
        t0 = time.perf_counter()
        with meter:
            schedule.step(*((tokens,) if first else ()),
                          **({"target": targets, "losses": []} if last else {}))
        dist.barrier()
        if step >= args.warmup or step == 0:
            peaks.append(meter.peak)
            fwd.append(meter.forward_peak)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    _FWD[:] = [max(fwd[1:] or fwd)]
    return max(peaks[1:] or peaks), statistics.median(times)


def _multi_rows(args, rank, config, name):
    """none, full, and per budget: ``shared`` (one MemoryBudget object per rank
    for both of its stage modules, planned jointly against the concurrent peak),
    ``sum`` (the same against the sum of their own peaks) and ``split`` (two
    objects of half the budget each: each stage module its own share)."""
    rows = []
    peak_none, t_none, _ = _run_multi(args, rank, name, (None, None), config)
    peak_full, t_full, _ = _run_multi(args, rank, name, ("full", "full"), config)
    nones, fulls = all_gather_objects(peak_none), all_gather_objects(peak_full)
    for variant, peaks, step in (("none", nones, t_none), ("full", fulls, t_full)):
        rows.append({"schedule": name, "variant": variant, "budget": None,
                     "peak_per_rank": peaks, "step_ms": max(all_gather_objects(step)) * 1e3,
                     "recompute_ms": None, "decisions": None})
    lo, hi = max(fulls), max(nones)
    for frac in args.fractions:
        budget = int(lo + frac * (hi - lo))
        shared = remat.MemoryBudget(bytes=budget)
        halves = (remat.MemoryBudget(bytes=budget // 2), remat.MemoryBudget(bytes=budget // 2))
        summed = remat.MemoryBudget(bytes=budget, plan_against="sum")
        for variant, policies in (("shared", (shared, shared)), ("sum", (summed, summed)),
                                  ("split", halves)):
            try:
                peak, step, mods = _run_multi(args, rank, name, policies, config)
            except Exception as e:  # a half too small for its stage
                err = type(e).__name__
                all_gather_objects(err)
                rows.append({"schedule": name, "variant": variant, "budget": budget,
                             "fraction": frac, "infeasible": True})
                continue
            plans = [remat.budget.current_plan(m) for m in mods]
            recompute = args.micro * sum(p.predicted_time_s for p in plans)
            rows.append({
                "schedule": name, "variant": variant, "budget": budget, "fraction": frac,
                "peak_per_rank": all_gather_objects(peak),
                "forward_peak_per_rank": all_gather_objects(_FWD[0]),
                "step_ms": max(all_gather_objects(step)) * 1e3,
                "recompute_ms": sum(all_gather_objects(recompute)) * 1e3,
                "decisions": all_gather_objects(
                    [d for p in plans for d in p.decisions().values()]
                ),
                "bound_per_rank": all_gather_objects(max(p.rank_peak_bytes for p in plans)),
            })
    return rows


def _uniform(tables, budget):
    """The one decision vector (by block position) of least summed recompute time
    whose predicted peak fits ``budget`` on every stage; None if none does."""
    n = len(tables[0]["blocks"])
    labels = list(tables[0]["blocks"][0])
    best = None
    for choice in itertools.product(labels, repeat=n):
        time_s, fits = 0.0, True
        for tab in tables:
            w = tab["outside"] + sum(tab["blocks"][b][c][0] for b, c in enumerate(choice))
            fits &= tab["in_flight"] * w <= budget
            time_s += sum(tab["blocks"][b][c][1] for b, c in enumerate(choice))
        if fits and (best is None or time_s < best[0]):
            best = (time_s, choice)
    return None if best is None else list(best[1])


def _policy_of(choice, names):
    decided = dict(zip(names, choice))

    def policy(name, module):
        label = decided[name]
        if label in ("full", "none"):
            return label
        return {p: "save" for p in label.removeprefix("save ").split("+")}

    return policy


def _worker(rank, args, store_path, out_path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    config = GPTConfig(vocab_size=256, seq_len=args.seq, dim=args.dim, n_heads=4,
                       n_layers=2 * args.layers)
    rows = []
    for schedule_name in args.schedules:
        if schedule_name in MULTI:
            rows.extend(_multi_rows(args, rank, config, schedule_name))
            continue
        peak_none, t_none, _ = _run(args, rank, schedule_name, None, config)
        peak_full, t_full, _ = _run(args, rank, schedule_name, "full", config)
        nones = all_gather_objects(peak_none)
        fulls = all_gather_objects(peak_full)
        for variant, peaks, step in (("none", nones, t_none), ("full", fulls, t_full)):
            steps = all_gather_objects(step)
            rows.append({"schedule": schedule_name, "variant": variant, "budget": None,
                         "peak_per_rank": peaks, "step_ms": max(steps) * 1e3,
                         "recompute_ms": None, "decisions": None})
        lo, hi = max(fulls), max(nones)
        for frac in args.fractions:
            budget = int(frac * hi) if args.of_none else int(lo + frac * (hi - lo))
            peak, step, module = _run(args, rank, schedule_name,
                                      remat.MemoryBudget(bytes=budget), config)
            plan = remat.budget.current_plan(module)
            mine = {
                "outside": plan.outside_bytes + plan.loss_bytes, "in_flight": plan.in_flight,
                "blocks": [b.candidates for b in plan.blocks],
                "names": [b.name for b in plan.blocks],
            }
            tables = all_gather_objects(mine)
            recompute = args.micro * plan.predicted_time_s
            per = {
                "peak_per_rank": all_gather_objects(peak),
                "forward_peak_per_rank": all_gather_objects(_FWD[0]),
                "step_ms": max(all_gather_objects(step)) * 1e3,
                "recompute_ms": sum(all_gather_objects(recompute)) * 1e3,
                "decisions": all_gather_objects(list(plan.decisions().values())),
                "in_flight": all_gather_objects(plan.in_flight),
            }
            rows.append({"schedule": schedule_name, "variant": "per-stage",
                         "budget": budget, "fraction": frac, **per})
            choice = None if args.no_uniform else _uniform(tables, budget)
            if args.no_uniform:
                continue
            if choice is None:
                rows.append({"schedule": schedule_name, "variant": "uniform",
                             "budget": budget, "fraction": frac, "infeasible": True})
                continue
            u_peak, u_step, _ = _run(args, rank, schedule_name,
                                     _policy_of(choice, mine["names"]), config)
            u_recompute = args.micro * sum(
                mine["blocks"][b][c][1] for b, c in enumerate(choice)
            )
            rows.append({
                "schedule": schedule_name, "variant": "uniform", "budget": budget,
                "fraction": frac,
                "peak_per_rank": all_gather_objects(u_peak),
                "step_ms": max(all_gather_objects(u_step)) * 1e3,
                "recompute_ms": sum(all_gather_objects(u_recompute)) * 1e3,
                "decisions": [choice, choice],
            })
    for row in rows:
        peaks = row.get("peak_per_rank")
        if peaks:
            row["imbalance"] = max(peaks) / statistics.mean(peaks)
            if row["budget"] is not None:
                row["fits"] = max(peaks) <= row["budget"]
    if rank == 0:
        config_out = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        result = {"config": config_out, "rows": rows}
        Path(out_path).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def format_table(result) -> str:
    head = (f"{'schedule':<14} {'variant':<10} {'budget':>10} {'peak r0':>10} "
            f"{'peak r1':>10} {'bnd|fwd r0':>10} {'bnd|fwd r1':>10} {'max/mean':>8} "
            f"{'recomp ms':>9} {'step ms':>8}  decisions")
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        if r.get("infeasible"):
            why = ("(a half of the budget is below a stage's full recompute)"
                   if r["variant"] == "split" else "(no single plan fits every stage)")
            lines.append(f"{r['schedule'][:14]:<14} {r['variant']:<10} "
                         f"{r['budget'] / 2**10:>8.0f}Ki  {why}")
            continue
        budget = "" if r["budget"] is None else f"{r['budget'] / 2**10:.0f}Ki"
        rec = "" if r["recompute_ms"] is None else f"{r['recompute_ms']:.2f}"
        dec = ""
        if r["decisions"]:
            dec = " | ".join(",".join(d.replace("save ", "s:") for d in ds) for ds in r["decisions"])
        p0, p1 = (p / 2**10 for p in r["peak_per_rank"])
        bounds = (r.get("bound_per_rank") if r["schedule"] in MULTI
                  else r.get("forward_peak_per_rank")) or []
        b0, b1 = (f"{b / 2**10:.0f}Ki" for b in bounds) if bounds else ("", "")
        lines.append(
            f"{r['schedule'][:14]:<14} {r['variant']:<10} {budget:>10} {p0:>8.0f}Ki {p1:>8.0f}Ki "
            f"{b0:>10} {b1:>10} {r['imbalance']:>8.2f} {rec:>9} {r['step_ms']:>8.1f}  {dec}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="blocks per stage")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--schedules", nargs="+",
                        default=["Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B"])
    parser.add_argument("--of-none", action="store_true",
                        help="Schedule1F1B / ScheduleGPipe budgets as fractions of the no-"
                             "checkpoint peak (default: of the way from full to none)")
    parser.add_argument("--no-uniform", action="store_true",
                        help="leave out the uniform plan rows")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        mp.spawn(_worker, args=(args, str(Path(tmp) / "store"), str(out)), nprocs=2)
        result = json.loads(out.read_text())
    print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
