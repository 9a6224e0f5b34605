"""``python -m benchmarks.core``: memory and time side by side with the alternatives.

Single process, on the reference GPT stack (then the distributed rows of
``benchmarks.dist`` on 2 torchrun ranks, unless ``--dist 0``). Every variant runs in the same process,
interleaved (one iteration of each in turn), and the table reports medians after
warm-up as ratios to no checkpointing and to ``torch.utils.checkpoint``: this machine
is noisy, absolute times vary, ratios measured in one run do not.

Per variant:
- ``saved_bytes``: what backward will need after forward (unique storages seen by an
  outermost ``remat_dist.saved_tensors_hooks``, which also sees checkpoint inputs,
  ``torch.utils.checkpoint``'s included, save-region saves and persisted outputs;
  parameters excluded), plus the op outputs torch's selective checkpointing caches
  (read from its cache by the saved-tensors report). Single process: no collective
  outputs are kept; the distributed table counts those (``benchmarks.dist``);
- ``live_after_forward_bytes``: activation bytes alive right after forward, measured
  independently of hooks and reports;
- ``peak_bytes``: peak of live tensor bytes over one forward+backward, in a separate
  untimed pass (CUDA: the allocator's peak; CPU: torch's ``MemTracker``);
- ``time_ms``: median forward+backward time;
- ``x_none`` / ``x_torch``: time ratios to no checkpointing / torch.utils.checkpoint;
- ``recompute_eff``: extra time over no checkpointing divided by the time of one
  forward of the part that is recomputed (1.0 is the limit; above it is overhead).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint as tuc

import remat_dist as remat
from remat_dist.core import live_scope_records
from remat_dist.models import GPT, GPTConfig, make_batch
from remat_dist.report import build_saved_tensors_report
from remat_dist.testing import SavedBytesCounter

__all__ = ["BenchConfig", "main", "run_single_process"]


@dataclass
class BenchConfig:
    """One single-process benchmark size."""

    batch: int = 8
    """Sequences per step."""
    seq: int = 256
    """Tokens per sequence."""
    dims: tuple[int, ...] = (512, 64)
    """Model widths to run (512: compute-bound; 64: Python-overhead-bound)."""
    heads: int = 8
    """Attention heads."""
    layers: int = 4
    """Transformer blocks."""
    iters: int = 10
    """Timed iterations per variant (medians are reported)."""
    warmup: int = 2
    """Untimed iterations per variant first."""
    threads: int = 0
    """torch.set_num_threads (0: leave as is)."""
    variants: tuple[str, ...] = field(default_factory=lambda: tuple(VARIANTS))
    """Which variants to run (default: all available)."""
    device: str = "cpu"
    """Where the single-process part runs (``cuda``: CUDA times and peak memory)."""


def _attention_kept(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    attn = remat.region(block.attention, "attention", recompute=False)(block.ln1(x))
    remat.recompute_needs_tensor(attn)
    x = x + attn
    return x + block.mlp(block.ln2(x))


def _sac_context() -> Any:
    aten = torch.ops.aten
    keep = [aten.mm.default, aten.addmm.default, aten.bmm.default]
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ):
        op = getattr(aten, name, None)
        if op is not None:
            keep.append(op.default)
    return tuc.create_selective_checkpoint_contexts(keep)


Runner = Callable[[torch.nn.Module, torch.Tensor, str], torch.Tensor]


def _runner_none() -> Runner | None:
    return None


def _runner_torch() -> Runner:
    return lambda block, x, name: tuc.checkpoint(block, x, use_reentrant=False)


def _runner_sac() -> Runner:
    return lambda block, x, name: tuc.checkpoint(
        block, x, use_reentrant=False, context_fn=_sac_context
    )


def _runner_remat_full() -> Runner:
    return lambda block, x, name: remat.checkpoint(region_name=name)(block)(x)


def _runner_remat_attention() -> Runner:
    return lambda block, x, name: remat.checkpoint(region_name=name)(_attention_kept)(
        block, x
    )


def _runner_scope() -> Runner:
    def run(block: torch.nn.Module, x: torch.Tensor, name: str) -> torch.Tensor:
        with remat.gradient_checkpoint_scope():
            return block(x)

    return run


def _runner_torch_remat(keep_attention: bool) -> Runner:
    import torch_remat  # optional comparison, never a dependency

    def kept(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        attn = torch_remat.region(block.attention, "attention", recompute=False)(
            block.ln1(x)
        )
        torch_remat.recompute_needs_tensor(attn)
        x = x + attn
        return x + block.mlp(block.ln2(x))

    if keep_attention:
        return lambda block, x, name: torch_remat.checkpoint(region_name=name)(kept)(
            block, x
        )
    return lambda block, x, name: torch_remat.checkpoint(region_name=name)(block)(x)


VARIANTS: dict[str, Callable[[], Runner | None]] = {
    "none": _runner_none,
    "torch.utils.checkpoint": _runner_torch,
    "selective (save matmuls)": _runner_sac,
    "remat_dist full": _runner_remat_full,
    "remat_dist attention kept": _runner_remat_attention,
}
if hasattr(remat, "gradient_checkpoint_scope"):
    VARIANTS["remat_dist scope per block"] = _runner_scope
if importlib.util.find_spec("torch_remat") is not None:
    VARIANTS["torch_remat full"] = functools.partial(_runner_torch_remat, False)
    VARIANTS["torch_remat attention kept"] = functools.partial(
        _runner_torch_remat, True
    )

_RECOMPUTED = {
    "none": None,
    "torch.utils.checkpoint": "blocks",
    "selective (save matmuls)": None,
    "remat_dist full": "blocks",
    "remat_dist attention kept": "blocks-attention",
    "remat_dist scope per block": "blocks",
    "torch_remat full": "blocks",
    "torch_remat attention kept": "blocks-attention",
}


def _saved_bytes(model: GPT, tokens: torch.Tensor, targets: torch.Tensor) -> int:
    with SavedBytesCounter(model.parameters()) as count:
        loss = model.loss(tokens, targets)
    # a gradient_checkpoint_scope's inputs reach the hooks (its ops save them);
    # its own record adds RNG/state snapshots only
    scopes = sum(r.stats()["state_bytes"] for r in live_scope_records())
    # torch's selective checkpointing caches op outputs in its dispatch mode, where
    # no hook sees them; the report reads that cache
    cached = build_saved_tensors_report(loss).summary()["torch_checkpoint"]["cached_bytes"]
    loss.backward()
    model.zero_grad(set_to_none=True)
    return count.activation_bytes + scopes + cached


def mem_tracker() -> tuple[Any, Any] | None:
    """torch's CPU memory tracker: ``(MemTracker, its memory reference kinds)``;
    None where this torch has none (the peak and live columns then say ``-``).
    A private torch module: the benchmarks reach it here, the library never does."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    except ImportError:
        return None
    return MemTracker, _MemRefType


def _memory(model: GPT, tokens: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """Peak bytes over one step, and bytes live right after forward (activations
    only: parameters and gradients excluded), in an untimed pass."""
    if tokens.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = model.loss(tokens, targets)
        live = torch.cuda.memory_allocated() - base
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        model.zero_grad(set_to_none=True)
        return {"peak_bytes": peak, "live_after_forward_bytes": live}
    found = mem_tracker()
    if found is None:
        return {"peak_bytes": None, "live_after_forward_bytes": None}
    MemTracker, MemRefType = found
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss = model.loss(tokens, targets)
        now = tracker.get_tracker_snapshot("current")
        loss.backward()
    model.zero_grad(set_to_none=True)
    peak = tracker.get_tracker_snapshot("peak")
    live = sum(
        v["Total"] - v.get(MemRefType.PARAM, 0) - v.get(MemRefType.GRAD, 0)
        for v in now.values()
    )
    return {
        "peak_bytes": int(sum(v.get("Total", 0) for v in peak.values())),
        "live_after_forward_bytes": int(live),
    }


def _now(like: torch.Tensor) -> float:
    """Wall time, after the device's queued work (CUDA times are real)."""
    if like.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def _forward_times(model: GPT, tokens: torch.Tensor, iters: int) -> dict[str, float]:
    """Median no-grad forward time of all blocks, and of all attention calls."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    x0 = (model.tok_emb(tokens) + model.pos_emb(positions)).detach()
    blocks, attns = [], []
    with torch.no_grad():
        for _ in range(iters):
            t0 = _now(tokens)
            x = x0
            for b in model.layers:
                x = b(x)
            blocks.append(_now(tokens) - t0)
            t0 = _now(tokens)
            for b in model.layers:
                b.attention(x0)
            attns.append(_now(tokens) - t0)
    return {"blocks": statistics.median(blocks), "attention": statistics.median(attns)}


def run_single_process(cfg: BenchConfig, dim: int) -> list[dict[str, Any]]:
    """All variants at width ``dim``; one row (dict) per variant."""
    gcfg = GPTConfig(
        vocab_size=256,
        seq_len=cfg.seq,
        dim=dim,
        n_heads=cfg.heads if dim % cfg.heads == 0 else 1,
        n_layers=cfg.layers,
    )
    model = GPT(gcfg, device=cfg.device)
    tokens, targets = (t.to(cfg.device) for t in make_batch(gcfg, cfg.batch, seed=0))
    names = [v for v in cfg.variants if v in VARIANTS]
    runners = {name: VARIANTS[name]() for name in names}

    def step(name: str) -> float:
        model.block_runner = runners[name]
        t0 = _now(tokens)
        model.loss(tokens, targets).backward()
        elapsed = _now(tokens) - t0
        model.zero_grad(set_to_none=True)
        return elapsed

    for _ in range(cfg.warmup):
        for name in names:
            step(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(cfg.iters):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            times[name].append(step(name))
    fwd = _forward_times(model, tokens, max(3, cfg.iters // 2))
    med = {name: statistics.median(v) for name, v in times.items()}
    rows = []
    for name in names:
        model.block_runner = runners[name]
        saved = _saved_bytes(model, tokens, targets)
        memory = _memory(model, tokens, targets)
        part = _RECOMPUTED.get(name)
        recomputed = {
            None: None,
            "blocks": fwd["blocks"],
            "blocks-attention": fwd["blocks"] - fwd["attention"],
        }[part]
        extra = med[name] - med.get("none", float("nan"))
        rows.append(
            {
                "dim": dim,
                "variant": name,
                "saved_bytes": saved,
                **memory,
                "time_ms": med[name] * 1e3,
                "x_none": med[name] / med["none"] if "none" in med else None,
                "x_torch": (
                    med[name] / med["torch.utils.checkpoint"]
                    if "torch.utils.checkpoint" in med
                    else None
                ),
                "recompute_eff": extra / recomputed if recomputed else None,
            }
        )
    model.block_runner = None
    return rows


def _live_tensor_bytes() -> int:
    """Bytes of every live plain tensor's storage (each once), found through gc."""
    import gc
    import warnings

    from remat_dist.core import storage_key, storage_nbytes

    seen: dict[Any, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on deprecated module proxies
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        if type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter):
            try:
                seen[storage_key(obj)] = storage_nbytes(obj)
            except (RuntimeError, NotImplementedError):
                continue
    return sum(seen.values())


def run_steady_state(steps: int = 100, dim: int = 64) -> dict[str, Any]:
    """Train ``steps`` steps with save regions and persisted outputs; after each
    backward record the live checkpoint records and all live tensor bytes. Both
    must be flat: nothing saved outlives its backward."""
    from remat_dist.core import live_records

    gcfg = GPTConfig(vocab_size=256, seq_len=32, dim=dim, n_heads=4, n_layers=2)
    model = GPT(gcfg)
    model.block_runner = _runner_remat_attention()
    optim = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    records, live = [], []
    for step in range(steps):
        tokens, targets = make_batch(gcfg, 4, seed=step)
        model.loss(tokens, targets).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        del tokens, targets
        records.append(len(live_records()))
        live.append(_live_tensor_bytes())
    model.block_runner = None
    return {
        "steps": steps,
        "live_records_after_backward": {"first": records[0], "max": max(records), "last": records[-1]},
        "live_tensor_bytes_after_backward": {"first": live[1], "max": max(live[1:]), "last": live[-1]},
        "flat": max(records) == 0 and max(live[1:]) == min(live[1:]),
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:9.2f}"


def _ratio(x: float | None) -> str:
    return "    -" if x is None else f"{x:5.3f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table of benchmark rows."""
    head = (
        f"{'dim':>4}  {'variant':<28} {'saved MiB':>9} {'live MiB':>9} {'peak MiB':>9} "
        f"{'time ms':>9} {'x none':>6} {'x torch':>7} {'recomp eff':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['dim']:>4}  {r['variant']:<28} {_mib(r['saved_bytes'])} "
            f"{_mib(r['live_after_forward_bytes'])} {_mib(r['peak_bytes'])} {r['time_ms']:9.2f} {_ratio(r['x_none']):>6} "
            f"{_ratio(r['x_torch']):>7} {_ratio(r['recompute_eff']):>10}"
        )
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.core", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--batch", type=int, default=BenchConfig.batch)
    parser.add_argument("--seq", type=int, default=BenchConfig.seq)
    parser.add_argument("--dims", type=int, nargs="+", default=list(BenchConfig.dims))
    parser.add_argument("--layers", type=int, default=BenchConfig.layers)
    parser.add_argument("--heads", type=int, default=BenchConfig.heads)
    parser.add_argument("--iters", type=int, default=BenchConfig.iters)
    parser.add_argument("--warmup", type=int, default=BenchConfig.warmup)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu | cuda (single-process part)")
    parser.add_argument("--variants", nargs="+", default=None, help="subset to run")
    parser.add_argument("--steady-steps", type=int, default=100, help="steady-state steps (0: skip)")
    parser.add_argument(
        "--dist", type=int, default=2, help="ranks for the distributed part (0: skip)"
    )
    parser.add_argument("--dist-iters", type=int, default=8)
    parser.add_argument("--json", default=None, help="write results to this path")
    args = parser.parse_args(argv)
    cfg = BenchConfig(
        batch=args.batch,
        seq=args.seq,
        dims=tuple(args.dims),
        heads=args.heads,
        layers=args.layers,
        iters=args.iters,
        warmup=args.warmup,
        threads=args.threads,
        device=args.device,
        variants=tuple(args.variants) if args.variants else tuple(VARIANTS),
    )
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rows: list[dict[str, Any]] = []
    for dim in cfg.dims:
        rows += run_single_process(cfg, dim)
    print(format_table(rows))
    steady = None
    if args.steady_steps:
        steady = run_steady_state(args.steady_steps)
        lr, lb = steady["live_records_after_backward"], steady["live_tensor_bytes_after_backward"]
        print(
            f"\nsteady state over {steady['steps']} steps (attention kept, persisted "
            f"outputs): live records after backward max {lr['max']}; live tensor bytes "
            f"after backward first {lb['first']:,} max {lb['max']:,} last {lb['last']:,}"
            f" -> {'flat' if steady['flat'] else 'GROWING'}"
        )
    distributed = None
    if args.dist:
        from benchmarks.dist import format_dist_table, run_distributed_bench

        distributed = run_distributed_bench(args.dist, iters=args.dist_iters)
        print(f"\ndistributed ({args.dist} gloo ranks, torchrun):")
        print(format_dist_table(distributed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": asdict(cfg),
                    "environment": environment(),
                    "rows": rows,
                    "steady_state": steady,
                    "distributed": distributed,
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
