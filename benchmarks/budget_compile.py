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
* ``MemoryBudget <f>``: ``MemoryBudget(bytes=<the bytes min-cut <f> kept>,
  compile=...)``: eager profiling step pricing every candidate compiled (with
  inductor also each block at min-cut levels of its own), then each block
  compiled once with the plan; its ``x matched`` is its step time over
  ``min-cut <f>``'s;
* ``MemoryBudget <f> blocks``: the same with the bytes ``min-cut <f> blocks``
  kept, its ``x matched`` over that row's: equal bytes at the same compile
  scope, the comparison for a model compiled per block as torchtitan does.

Every variant is built and warmed first (compiled; the budget's profiling step
run), then ``--iters`` rounds time one step (forward, loss, backward) of each
variant in a rotating order, in the process's CPU time on one thread
(``--threads``). The ratios (``x compile``, ``x matched``) are the median over
rounds of the ratio within a round, so a machine that slows down between rounds
slows both sides alike; ``x matched`` comes with a seeded bootstrap 95%
interval. Each min-cut level compiles with a backend of its own, so no two
variants share a graph, and a graph compiled while timing is an error. Bytes:
the peak of every byte saved for backward over a whole step, the loss included
(unique storages, parameters apart;
``remat_dist.testing.PeakSavedBytes(whole_step=True)``), over two steps after
warm-up. ``time_ms`` (CPU) and ``wall_ms`` (wall clock) are the medians over
rounds.

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
from benchmarks.dist import _median_ci95  # noqa: E402
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


def _min_cut(fraction: float):
    """Inductor under ``activation_memory_budget=fraction``, as a backend object
    of its own: Dynamo does not reuse a graph compiled for another backend, so
    variants at different fractions never share one."""
    inductor = torch._dynamo.lookup_backend("inductor")

    def backend(gm, example_inputs):
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            return inductor(gm, example_inputs)

    backend.__name__ = f"inductor_min_cut_{fraction:g}"
    return backend


def _peak(model, run, steps: int) -> int:
    """The peak of every byte saved for backward over ``steps`` whole steps."""
    meter = PeakSavedBytes(model, whole_step=True)
    peak = 0
    for _ in range(steps):
        meter.reset()
        with meter:
            run()
        peak = max(peak, meter.peak)
    return peak


def run_model(name: str, args) -> list[dict[str, Any]]:
    """Every variant built and warmed (compiled, the budget's profiling step run),
    its bytes measured, then ``--iters`` rounds that time one step of each variant
    in a rotating order: ratios are taken within a round, so that a machine that
    slows down slows every variant of the round alike."""
    build, step, blocks_of, apply_kw = {"gpt": _gpt, "llama": _llama}[name](args)
    options = {"fullgraph": name == "gpt"}
    variants: dict[str, Any] = {}
    rows: dict[str, dict[str, Any]] = {}

    def add(variant, model, call=None, **extra):
        call = model if call is None else call

        def run():
            for p in model.parameters():
                p.grad = None
            step(call)

        for _ in range(args.warmup):
            run()
        rows[variant] = {"model": name, "variant": variant,
                         "saved_bytes": _peak(model, run, 2), **extra}
        variants[variant] = run
        print(f"  {name:<6} {variant:<22} {rows[variant]['saved_bytes'] / 2**20:8.2f} MiB",
              file=sys.stderr, flush=True)
        return rows[variant]

    def add_budget(f, matched):
        """``MemoryBudget(bytes=<what the variant ``matched`` kept>)``, or a row that
        says the budget is below the blocks' full recompute."""
        variant = "MemoryBudget " + matched.split(" ", 1)[1]
        budget = rows[matched]["saved_bytes"]
        m = build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            remat.apply_remat(m, policy=remat.MemoryBudget(bytes=budget, compile=options),
                              **apply_kw)
        try:
            ours = add(variant, m, fraction=f, budget_bytes=budget, matched=matched)
        except remat.RematUsageError as e:
            smallest = int(str(e).split("smallest feasible budget is ")[1].split()[0]
                           .replace(",", ""))
            rows[variant] = {"model": name, "variant": variant, "fraction": f,
                             "matched": matched, "budget_bytes": budget, "infeasible": True,
                             "smallest_bytes": smallest}
            print(f"  {name:<6} {variant}: infeasible, smallest {smallest / 2**20:.2f} MiB",
                  file=sys.stderr, flush=True)
            return
        ours["decisions"] = list(remat.budget.current_plan(m).decisions().values())
        ours["within_budget"] = ours["saved_bytes"] <= budget

    add("eager no AC", build())
    m = build()
    for b in blocks_of(m):
        b.compile(**options)
    add("compile no AC", m)
    for f in args.fractions:
        m = build()
        add(f"min-cut {f:g}", m, torch.compile(m, backend=_min_cut(f)), fraction=f)
        # the same partitioner at the same level with the budget's compile
        # scope: each block compiled, the code around them eager
        m = build()
        for b in blocks_of(m):
            b.compile(backend=_min_cut(f), **options)
        add(f"min-cut {f:g} blocks", m, fraction=f)
        for matched in (f"min-cut {f:g}", f"min-cut {f:g} blocks"):
            add_budget(f, matched)

    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    names = list(variants)
    times: dict[str, list[float]] = {v: [] for v in names}
    walls: dict[str, list[float]] = {v: [] for v in names}
    for i in range(args.iters):
        k = i % len(names)
        for v in names[k:] + names[:k]:
            t0, c0 = time.perf_counter(), time.process_time()
            variants[v]()
            times[v].append(time.process_time() - c0)
            walls[v].append(time.perf_counter() - t0)
    recompiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    if recompiled:
        raise RuntimeError(f"{name}: {recompiled} graph(s) compiled while timing; "
                           "the variants' graphs must all exist before the rounds")

    def paired(v: str, ref: str) -> tuple[float, tuple[float, float]]:
        ratios = [a / b for a, b in zip(times[v], times[ref])]
        return statistics.median(ratios), _median_ci95(ratios)

    for v in names:
        row = rows[v]
        row["time_ms"] = 1e3 * statistics.median(times[v])
        row["wall_ms"] = 1e3 * statistics.median(walls[v])
        row["x_compile_no_ac"] = paired(v, "compile no AC")[0]
        if "matched" in row:
            ratio, interval = paired(v, row["matched"])
            row["x_matched"], row["x_matched_95"] = ratio, interval
    return list(rows.values())


def _plan(decisions: list[str]) -> str:
    """The blocks' decisions in order, a run of equal ones as ``d (xN)``."""
    runs: list[list] = []
    for d in decisions:
        if runs and runs[-1][0] == d:
            runs[-1][1] += 1
        else:
            runs.append([d, 1])
    return ", ".join(d if n == 1 else f"{d} (x{n})" for d, n in runs)


def format_table(rows) -> str:
    head = (f"{'model':<6} {'variant':<23} {'saved MiB':>9} {'time ms':>8} "
            f"{'x compile':>9} {'x matched [95%]':>22}  plan")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("infeasible"):
            lines.append(f"{r['model']:<6} {r['variant']:<23} below the blocks' full "
                         f"recompute: smallest budget {r['smallest_bytes'] / 2**20:.2f} MiB "
                         f"({r['matched']} kept {r['budget_bytes'] / 2**20:.2f} MiB)")
            continue
        cut = (f"{r['x_matched']:9.2f} [{r['x_matched_95'][0]:.2f}, {r['x_matched_95'][1]:.2f}]"
               if "x_matched" in r else "")
        plan = f"  {_plan(r['decisions'])}" if "decisions" in r else ""
        lines.append(f"{r['model']:<6} {r['variant']:<23} {r['saved_bytes'] / 2**20:9.2f} "
                     f"{r['time_ms']:8.1f} {r['x_compile_no_ac']:9.2f} {cut:>22}{plan}".rstrip())
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
    # every variant's graphs stay compiled side by side (a Llama layer's forward
    # has one graph per backend), none evicted by Dynamo's default limit of 8
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._dynamo.config.accumulated_cache_size_limit = max(
        torch._dynamo.config.accumulated_cache_size_limit, 512)
    rows = [r for name in args.models for r in run_model(name, args)]
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
