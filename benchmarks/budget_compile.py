"""The compiled memory budget against torch.compile's own, at equal saved bytes.

For each model (the reference GPT with its cross-entropy outside the model, and
a transformers Llama from a small config, random init, its loss inside), all in
one run so that the ratios compare on a noisy machine:

* ``compile no AC``: every block compiled (inductor), no checkpointing;
* ``min-cut <f>``: ``torch.compile(model)`` with torch's
  ``activation_memory_budget = f`` (the min-cut partitioner chooses what to
  save); its measured bytes are the matched level for the ``MemoryBudget`` row;
* ``min-cut <f> blocks``: the same level with the budget's compile scope, each
  block compiled and the code around them (embedding, head, loss) eager;
* ``MemoryBudget <f>``: ``MemoryBudget(bytes=<min-cut's bytes>,
  compile=...)``: eager profiling step pricing every candidate compiled (with
  inductor also each block at a min-cut level of its own), then each block
  compiled once with the plan.

Bytes: the peak of every byte saved for backward over a whole step, the loss
included (unique storages, parameters apart;
``remat_dist.testing.PeakSavedBytes(whole_step=True)``),
after warm-up; time: the median step (forward, loss, backward) in the process's
CPU time on one thread (``--threads``), which other processes on shared cores do
not inflate (``wall_ms``, the wall-clock median, is in the JSON).

    python benchmarks/budget_compile.py --json budget_compile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import remat_dist as remat  # noqa: E402
from remat_dist.models import GPT, Block, GPTConfig, make_batch  # noqa: E402
from remat_dist.testing import PeakSavedBytes  # noqa: E402


def _gpt(args):
    config = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, dim=args.dim, n_heads=4,
                       n_layers=args.layers)
    tokens, targets = make_batch(config, args.batch, seed=0)

    def build():
        torch.manual_seed(0)
        return GPT(config)

    def step(model):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()

    return build, step, (lambda m: list(m.layers)), {"blocks": Block}


def _llama(args):
    import transformers as tf

    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1))

    def build():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tf.LlamaForCausalLM(tf.LlamaConfig(
                hidden_size=args.dim, intermediate_size=2 * args.dim,
                num_hidden_layers=args.layers, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=args.vocab,
                max_position_embeddings=max(args.seq, 128))).train()

    def step(model):
        model(input_ids=ids, labels=ids).loss.backward()

    return build, step, (lambda m: list(m.model.layers)), {}


def _measure(model, step, args) -> dict[str, Any]:
    """The peak over the timed steps and their median time (after ``--warmup``
    steps: the budget's profiling step and the compiles)."""
    meter = PeakSavedBytes(model, whole_step=True)
    peak, times = 0, []
    for i in range(args.warmup + args.iters):
        for p in model.parameters():
            p.grad = None
        meter.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        with meter:
            step(model)
        if i >= args.warmup:
            times.append((time.process_time() - c0, time.perf_counter() - t0))
            peak = max(peak, meter.peak)
    return {"saved_bytes": peak, "time_ms": 1e3 * statistics.median(t for t, _ in times),
            "wall_ms": 1e3 * statistics.median(w for _, w in times)}


def run_model(name: str, args) -> list[dict[str, Any]]:
    build, step, blocks_of, apply_kw = {"gpt": _gpt, "llama": _llama}[name](args)
    rows: list[dict[str, Any]] = []
    options = {"fullgraph": name == "gpt"}

    def add(variant, model, **extra):
        torch._dynamo.reset()
        row = {"model": name, "variant": variant, **_measure(model, step, args), **extra}
        rows.append(row)
        print(f"  {name:<6} {variant:<22} {row['saved_bytes'] / 2**20:8.2f} MiB "
              f"{row['time_ms']:9.1f} ms", file=sys.stderr, flush=True)
        return row

    add("eager no AC", build())
    m = build()
    for b in blocks_of(m):
        b.compile(**options)
    base = add("compile no AC", m)
    for f in args.fractions:
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=f):
            cut = add(f"min-cut {f:g}", torch.compile(build()), fraction=f)
        # the same partitioner at the same level with the budget's compile
        # scope: each block compiled, the code around them eager
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=f):
            m = build()
            for b in blocks_of(m):
                b.compile(**options)
            add(f"min-cut {f:g} blocks", m, fraction=f)
        budget = cut["saved_bytes"]
        m = build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            remat.apply_remat(m, policy=remat.MemoryBudget(bytes=budget, compile=options),
                              **apply_kw)
        try:
            ours = add(f"MemoryBudget {f:g}", m, fraction=f, budget_bytes=budget)
        except remat.RematUsageError as e:  # below the blocks' full recompute
            smallest = int(str(e).split("smallest feasible budget is ")[1].split()[0]
                           .replace(",", ""))
            rows.append({"model": name, "variant": f"MemoryBudget {f:g}", "fraction": f,
                         "budget_bytes": budget, "infeasible": True,
                         "smallest_bytes": smallest})
            print(f"  {name:<6} MemoryBudget {f:g}: infeasible, smallest "
                  f"{smallest / 2**20:.2f} MiB", file=sys.stderr, flush=True)
            continue
        ours["decisions"] = list(remat.budget.current_plan(m).decisions().values())
        ours["x_min_cut"] = ours["time_ms"] / cut["time_ms"]
        ours["within_budget"] = ours["saved_bytes"] <= budget
    for r in rows:
        if "time_ms" in r:
            r["x_compile_no_ac"] = r["time_ms"] / base["time_ms"]
    return rows


def format_table(rows) -> str:
    head = (f"{'model':<6} {'variant':<20} {'saved MiB':>10} {'time ms':>9} "
            f"{'x compile':>10} {'x min-cut':>10}  plan")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("infeasible"):
            lines.append(f"{r['model']:<6} {r['variant']:<20} below the blocks' full "
                         f"recompute: smallest budget {r['smallest_bytes'] / 2**20:.2f} MiB "
                         f"(min-cut kept {r['budget_bytes'] / 2**20:.2f} MiB)")
            continue
        cut = f"{r['x_min_cut']:10.2f}" if "x_min_cut" in r else " " * 10
        plan = f"  {', '.join(r['decisions'])}" if "decisions" in r else ""
        lines.append(f"{r['model']:<6} {r['variant']:<20} {r['saved_bytes'] / 2**20:10.2f} "
                     f"{r['time_ms']:9.1f} {r['x_compile_no_ac']:10.2f} {cut}{plan}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "llama"])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.3, 0.6])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [r for name in args.models for r in run_model(name, args)]
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
