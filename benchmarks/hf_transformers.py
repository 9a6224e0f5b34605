"""``python -m benchmarks.hf_transformers``: transformers models, side by side.

One row per architecture family (small configs, random init, nothing downloaded)
and variant, all measured in one run so that the ratios compare on a noisy machine:

* ``no AC``: the model as it is;
* ``HF checkpointing``: transformers' own ``gradient_checkpointing_enable()``
  (``torch.utils.checkpoint`` per decoder layer);
* ``remat full`` / ``remat attention kept``: ``apply_remat(model)`` (blocks found
  by remat_dist) with ``"full"`` / ``keep_attention(model)``;
* ``remat budget <p>%``: ``MemoryBudget`` at three byte levels, ``p`` of the way
  from full recompute's saved bytes to no checkpointing's;
* ``compile budget <p>%``: ``torch.compile`` of the whole model with torch's own
  ``torch._functorch.config.activation_memory_budget`` set to the same byte level
  (as a fraction of no checkpointing's bytes): the other tool that picks what to
  save under a budget.

Saved bytes are those of the forward, as ``remat_dist.testing.SavedBytesCounter``
counts them (unique storages, parameters apart); time is the median step
(forward + backward). Prints a table; ``--json PATH`` writes it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from remat_dist._torch import _dynamo

FAMILIES = ("llama", "qwen2", "mixtral", "gemma2", "gpt2")
LEVELS = (0.25, 0.5, 0.75)


@dataclass
class Config:
    families: tuple[str, ...] = FAMILIES
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    batch: int = 4
    seq: int = 128
    iters: int = 5
    warmup: int = 2
    compile: bool = True
    threads: int = 0
    levels: tuple[float, ...] = field(default=LEVELS)


def build(family: str, cfg: Config) -> torch.nn.Module:
    """A model of ``family`` at the bench size (seed 0), in training mode."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(
        hidden_size=cfg.hidden, intermediate_size=2 * cfg.hidden,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, vocab_size=256,
        max_position_embeddings=max(cfg.seq, 128),
    )
    kv = max(1, cfg.heads // 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family == "llama":
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_key_value_heads=cfg.heads))
        elif family == "qwen2":
            model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, num_key_value_heads=kv))
        elif family == "mixtral":
            model = tf.MixtralForCausalLM(tf.MixtralConfig(
                **common, num_key_value_heads=kv, num_local_experts=4, num_experts_per_tok=2))
        elif family == "gemma2":
            model = tf.Gemma2ForCausalLM(tf.Gemma2Config(
                **common, num_key_value_heads=kv, head_dim=cfg.hidden // cfg.heads,
                sliding_window=cfg.seq // 2, attn_implementation="eager"))
        elif family == "gpt2":
            model = tf.GPT2LMHeadModel(tf.GPT2Config(
                n_embd=cfg.hidden, n_layer=cfg.layers, n_head=cfg.heads, vocab_size=256,
                n_positions=max(cfg.seq, 128), bos_token_id=0, eos_token_id=0))
        else:
            raise SystemExit(f"bench --transformers: unknown family {family!r}")
    return model.train()


def _step(model: Any, ids: torch.Tensor, count: bool) -> int:
    from remat_dist.testing import SavedBytesCounter

    for p in model.parameters():
        p.grad = None
    counter = SavedBytesCounter(model.parameters()) if count else None
    with counter if counter is not None else contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return counter.activation_bytes if counter is not None else 0


def measure(model: Any, ids: torch.Tensor, cfg: Config) -> dict[str, Any]:
    """Saved bytes (of the last warm-up step, after any profiling or compiling) and
    the median step time of ``cfg.iters`` steps."""
    saved = 0
    for i in range(max(cfg.warmup, 2)):
        saved = _step(model, ids, count=i == max(cfg.warmup, 2) - 1)
    times = []
    for _ in range(cfg.iters):
        t0 = time.perf_counter()
        _step(model, ids, count=False)
        times.append(time.perf_counter() - t0)
    return {"saved_bytes": saved, "time_ms": 1e3 * statistics.median(times)}


def run_family(family: str, cfg: Config) -> list[dict[str, Any]]:
    import remat_dist as remat
    from remat_dist.integrations.transformers import keep_attention, layout

    ids = torch.randint(0, 256, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(1))
    rows: list[dict[str, Any]] = []

    def add(variant: str, model: Any, **extra: Any) -> dict[str, Any]:
        row = {"family": family, "variant": variant, **measure(model, ids, cfg), **extra}
        rows.append(row)
        print(f"  {family:<8} {variant:<24} {row['saved_bytes'] / 2**20:8.2f} MiB "
              f"{row['time_ms']:9.1f} ms", file=sys.stderr, flush=True)
        return row

    def remat_model(policy: Any) -> Any:
        model = build(family, cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the use_cache notice
            remat.apply_remat(model, policy=policy(model) if callable(policy) else policy)
        return model

    none = add("no AC", build(family, cfg), family_kind=layout(build(family, cfg)).family)
    hf = build(family, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.gradient_checkpointing_enable()
    add("HF checkpointing", hf)
    full = add("remat full", remat_model("full"))
    add("remat attention kept", remat_model(keep_attention))
    levels = [int(full["saved_bytes"] + p * (none["saved_bytes"] - full["saved_bytes"]))
              for p in cfg.levels]
    for p, budget in zip(cfg.levels, levels):
        add(f"remat budget {p:.0%}", remat_model(remat.MemoryBudget(bytes=budget)),
            budget_bytes=budget)
    if cfg.compile:
        for p, budget in zip(cfg.levels, levels):
            fraction = budget / none["saved_bytes"]
            _dynamo.reset()
            with _dynamo.functorch_config_patch(activation_memory_budget=fraction):
                add(f"compile budget {p:.0%}", torch.compile(build(family, cfg)),
                    budget_bytes=budget, activation_memory_budget=round(fraction, 4))
            _dynamo.reset()
    base = none["time_ms"]
    for r in rows:
        r["x_no_ac"] = r["time_ms"] / base
        if "budget_bytes" in r:
            r["within_budget"] = r["saved_bytes"] <= r["budget_bytes"]
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'family':<8} {'variant':<24} {'saved MiB':>10} {'time ms':>9} "
             f"{'x no AC':>8} {'budget MiB':>11}"]
    for r in rows:
        budget = f"{r['budget_bytes'] / 2**20:11.2f}" if "budget_bytes" in r else " " * 11
        lines.append(f"{r['family']:<8} {r['variant']:<24} "
                     f"{r['saved_bytes'] / 2**20:10.2f} {r['time_ms']:9.1f} "
                     f"{r['x_no_ac']:8.2f} {budget}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.hf_transformers",
        description=__doc__.split("\n")[0],
    )
    d = Config()
    parser.add_argument("--families", nargs="+", default=list(d.families), choices=FAMILIES)
    parser.add_argument("--hidden", type=int, default=d.hidden)
    parser.add_argument("--layers", type=int, default=d.layers)
    parser.add_argument("--heads", type=int, default=d.heads)
    parser.add_argument("--batch", type=int, default=d.batch)
    parser.add_argument("--seq", type=int, default=d.seq)
    parser.add_argument("--iters", type=int, default=d.iters)
    parser.add_argument("--warmup", type=int, default=d.warmup)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--no-compile", action="store_true",
                        help="leave out the torch.compile activation_memory_budget rows")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("benchmarks.hf_transformers needs transformers: pip install 'remat-dist[test]'",
              file=sys.stderr)
        return 2
    cfg = Config(
        families=tuple(args.families), hidden=args.hidden, layers=args.layers,
        heads=args.heads, batch=args.batch, seq=args.seq, iters=args.iters,
        warmup=args.warmup, compile=not args.no_compile, threads=args.threads,
    )
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rows: list[dict[str, Any]] = []
    for family in cfg.families:
        rows += run_family(family, cfg)
    print(format_table(rows))
    if args.json:
        from benchmarks.core import environment

        with open(args.json, "w") as f:
            json.dump({"config": asdict(cfg), "environment": environment(), "rows": rows},
                      f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
