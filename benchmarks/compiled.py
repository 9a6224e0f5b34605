"""``python -m benchmarks.compiled``: compiled blocks with and without remat.

Per-block compile as torchtitan does it: a stack of reference GPT blocks, each one
compiled on its own (``block.compile(backend=..., fullgraph=True)``), after the
checkpoint is applied. Variants, all in one process, timed interleaved (one
iteration of each in turn) with medians after warm-up, so that the ratios hold on a
noisy machine:

- ``compiled none``: no checkpointing;
- ``compiled torch.utils.checkpoint``: each block in
  ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (the partitioner then
  prefers recomputing, and may still save what it finds cheaper to keep);
- ``compiled remat full``: ``apply_remat(policy="full")``: every op of the block is
  recomputed, only its input is kept;
- ``compiled remat attention kept``: ``apply_remat(policy={"attention": "save"})``:
  the attention's saves are kept, the rest recomputed.

Columns: ``saved_bytes`` (what backward needs after forward: unique storages seen by
``remat_dist.testing.SavedBytesCounter``, which sees what a compiled graph saves;
parameters excluded), ``time_ms`` (median forward+backward), ``x_none`` /
``x_torch`` (time ratios to compiled no checkpointing / compiled
``torch.utils.checkpoint``). Compile time is not in the timings (warm-up compiles).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.utils.checkpoint as tuc
from torch import nn

import remat_dist as remat
from remat_dist._torch import _dynamo
from remat_dist.models import Block, GPTConfig
from remat_dist.testing import SavedBytesCounter

__all__ = ["BACKENDS", "CompileBenchConfig", "VARIANTS", "format_table", "main", "run"]

BACKENDS = ("inductor", "aot_eager")
"""Backends whose saved bytes the benchmark can measure (both run AOTAutograd)."""


@dataclass
class CompileBenchConfig:
    """One compiled-block benchmark size."""

    batch: int = 8
    """Sequences per step."""
    seq: int = 256
    """Tokens per sequence."""
    dim: int = 256
    """Model width."""
    heads: int = 8
    """Attention heads."""
    layers: int = 4
    """Blocks in the stack (each compiled on its own)."""
    iters: int = 10
    """Timed iterations per variant (medians are reported)."""
    warmup: int = 2
    """Untimed iterations per variant first (the first one compiles)."""
    backend: str = "inductor"
    """``torch.compile`` backend, one of :data:`BACKENDS`."""
    threads: int = 0
    """torch.set_num_threads (0: leave as is)."""


class _TorchCheckpointed(nn.Module):
    """A block under ``torch.utils.checkpoint`` (what gets compiled)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tuc.checkpoint(self.block, x, use_reentrant=False)


def _stack(cfg: CompileBenchConfig, variant: str) -> nn.ModuleList:
    """``cfg.layers`` blocks with the same weights in every variant, prepared as
    ``variant`` says and compiled one by one."""
    gcfg = GPTConfig(seq_len=cfg.seq, dim=cfg.dim, n_heads=cfg.heads, n_layers=cfg.layers)
    # One Block subclass per variant: Dynamo guards on the block's type and instance
    # forward, not on a submodule's instance _call_impl (how apply_remat makes a
    # policy region), so two variants of one class and name would share a graph.
    cls = type(f"Block_{VARIANTS.index(variant)}", (Block,), {})
    torch.manual_seed(0)
    blocks = nn.ModuleList(cls(gcfg) for _ in range(cfg.layers))
    if variant == "compiled remat full":
        remat.apply_remat(blocks, blocks=cls, policy="full")
    elif variant == "compiled remat attention kept":
        remat.apply_remat(blocks, blocks=cls, policy={"attention": "save"})
    elif variant == "compiled torch.utils.checkpoint":
        blocks = nn.ModuleList(_TorchCheckpointed(b) for b in blocks)
    for b in blocks:
        b.compile(backend=cfg.backend, fullgraph=True)
    return blocks


VARIANTS = (
    "compiled none",
    "compiled torch.utils.checkpoint",
    "compiled remat full",
    "compiled remat attention kept",
)


def _forward(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for b in blocks:
        x = b(x)
    return x.float().square().mean()


def run(cfg: CompileBenchConfig) -> list[dict[str, Any]]:
    """Every variant at ``cfg``'s size; one row (dict) per variant."""
    if cfg.backend not in BACKENDS:
        raise ValueError(
            f"bench --compile: backend {cfg.backend!r} is not one of {BACKENDS}"
        )
    _dynamo.reset()
    # every block shares nn.Module._call_impl's code: one cache entry per block
    limit = _dynamo.cache_size_limit()
    _dynamo.set_cache_size_limit(max(limit, 4 * len(VARIANTS) * cfg.layers))
    try:
        return _run(cfg)
    finally:
        _dynamo.set_cache_size_limit(limit)


def _run(cfg: CompileBenchConfig) -> list[dict[str, Any]]:
    x0 = torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=torch.Generator().manual_seed(1))
    stacks = {v: _stack(cfg, v) for v in VARIANTS}

    def step(variant: str) -> float:
        blocks = stacks[variant]
        x = x0.clone().requires_grad_(True)
        t0 = time.perf_counter()
        _forward(blocks, x).backward()
        elapsed = time.perf_counter() - t0
        blocks.zero_grad(set_to_none=True)
        return elapsed

    for _ in range(cfg.warmup):
        for v in VARIANTS:
            step(v)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    names = list(VARIANTS)
    for i in range(cfg.iters):
        for v in names[i % len(names) :] + names[: i % len(names)]:
            times[v].append(step(v))
    med = {v: statistics.median(t) for v, t in times.items()}
    rows = []
    for v in VARIANTS:
        blocks = stacks[v]
        x = x0.clone().requires_grad_(True)
        with SavedBytesCounter(blocks.parameters()) as count:
            loss = _forward(blocks, x)
        loss.backward()
        blocks.zero_grad(set_to_none=True)
        rows.append(
            {
                "variant": v,
                "backend": cfg.backend,
                "saved_bytes": count.activation_bytes,
                "time_ms": med[v] * 1e3,
                "x_none": med[v] / med["compiled none"],
                "x_torch": med[v] / med["compiled torch.utils.checkpoint"],
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table of the rows."""
    head = f"{'variant':<32} {'saved MiB':>10} {'time ms':>9} {'x none':>7} {'x torch':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['variant']:<32} {r['saved_bytes'] / 2**20:10.3f} {r['time_ms']:9.2f} "
            f"{r['x_none']:7.3f} {r['x_torch']:8.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, run, print the table, write ``--json``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    defaults = CompileBenchConfig()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compiled", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--seq", type=int, default=defaults.seq)
    parser.add_argument("--dim", type=int, default=defaults.dim)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--iters", type=int, default=defaults.iters)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument(
        "--backend",
        default=defaults.backend,
        choices=BACKENDS,
        help="torch.compile backend (not 'eager': without AOTAutograd, torch's "
        "selective checkpoint keeps the save regions' outputs in its own storage, "
        "which the saved-bytes counter cannot see)",
    )
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the rows to this path")
    args = parser.parse_args(argv)
    cfg = CompileBenchConfig(
        batch=args.batch, seq=args.seq, dim=args.dim, heads=args.heads,
        layers=args.layers, iters=args.iters, warmup=args.warmup,
        backend=args.backend, threads=args.threads,
    )
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rows = run(cfg)
    print(
        f"compiled blocks ({cfg.backend}, {cfg.layers} x dim {cfg.dim}, batch "
        f"{cfg.batch} x seq {cfg.seq}, {torch.get_num_threads()} threads, per-block "
        "compile, fullgraph)"
    )
    print(format_table(rows))
    if args.json:
        from benchmarks.core import environment

        with open(args.json, "w") as f:
            json.dump(
                {"config": asdict(cfg), "environment": environment(), "rows": rows},
                f, indent=2,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
