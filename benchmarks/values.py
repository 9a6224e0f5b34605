"""What ``determinism_check="values"`` costs: ``python -m benchmarks.values``.

On 2 gloo ranks (``remat_dist.testing``), three workloads, each as two models that
differ only in the check: the bench's tensor-parallel and FSDP2 GPT
(``benchmarks.dist``'s shapes: seq 64, dim 128, 4 layers, batch 4, every
block checkpointed with verified replay), and a mixture-of-experts block that
routes its tokens with two ``all_to_all_single`` inside one checkpoint. Each
iteration times one step (forward + backward) of both, in alternating order, and
the cost is the median over iterations of the within-iteration ratio
(values / none), of wall time and of rank 0's own CPU time (blind to the other
processes of a shared machine): the drift of the machine cancels in each pair.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def _gpt(layout: str, check: str, cfg: dict[str, Any]) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import remat_dist as remat
    from remat_dist.models import GPT, Block, GPTConfig, make_batch

    config = GPTConfig(
        vocab_size=256,
        seq_len=cfg["seq"],
        dim=cfg["dim"],
        n_heads=4,
        n_layers=cfg["layers"],
    )
    model = GPT(config)
    remat.apply_remat(model, blocks=Block, determinism_check=check)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(layout,))
    plan = remat.shard.reference_tp_plan() if layout == "tp" else None
    remat.shard_model(model, mesh, blocks=Block, tp_plan=plan)
    seed = 0 if layout == "tp" else dist.get_rank()
    batch = make_batch(config, cfg["batch"], seed=seed)

    def step() -> None:
        model.loss(*batch).backward()
        model.zero_grad(set_to_none=True)

    return step


def _moe(check: str, cfg: dict[str, Any]) -> Any:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import remat_dist as remat

    tokens, dim = cfg["moe_tokens"], cfg["dim"]
    g = torch.Generator().manual_seed(dist.get_rank())
    router = torch.randn(dim, generator=g, requires_grad=True)
    w1 = (torch.randn(dim, 4 * dim, generator=g) / dim**0.5).requires_grad_()
    w2 = (torch.randn(4 * dim, dim, generator=g) / (4 * dim) ** 0.5).requires_grad_()
    x = torch.randn(tokens, dim, generator=g, requires_grad=True)
    half = [tokens // 2, tokens // 2]

    def block(t: torch.Tensor) -> torch.Tensor:
        scores = t @ router
        order = scores.argsort(stable=True)
        send = t[order] * scores[order].sigmoid()[:, None]
        recv = funcol.all_to_all_single_autograd(send, half, half, dist.group.WORLD)
        h = torch.nn.functional.gelu(recv @ w1) @ w2
        back = funcol.all_to_all_single_autograd(h, half, half, dist.group.WORLD)
        return torch.zeros_like(back).index_copy(0, order, back)

    run = remat.checkpoint(region_name="moe", determinism_check=check)(block)

    def step() -> None:
        run(x).square().sum().backward()
        for p in (router, w1, w2, x):
            p.grad = None

    return step


def measure(cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs on every rank; rank 0's numbers are reported."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in ("tp", "fsdp", "moe"):
        steps = {
            c: (_moe(c, cfg) if name == "moe" else _gpt(name, c, cfg))
            for c in ("none", "values")
        }
        times: dict[str, list[float]] = {"none": [], "values": []}
        cpu: dict[str, list[float]] = {"none": [], "values": []}
        for it in range(cfg["warmup"] + cfg["iters"]):
            for c in ("none", "values") if it % 2 == 0 else ("values", "none"):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                steps[c]()
                if it >= cfg["warmup"]:
                    times[c].append(time.perf_counter() - t0)
                    cpu[c].append(time.process_time() - c0)
        out[name] = {"pairs": len(times["none"])}
        for kind, samples in (("wall", times), ("cpu", cpu)):
            ratios = [
                v / n for v, n in zip(samples["values"], samples["none"], strict=True)
            ]
            q = statistics.quantiles(ratios, n=4)
            out[name][kind] = {
                "ms_none": statistics.median(samples["none"]) * 1e3,
                "ms_values": statistics.median(samples["values"]) * 1e3,
                "ratio_median": statistics.median(ratios),
                "ratio_q1": q[0],
                "ratio_q3": q[2],
            }
    return out


def main() -> None:
    from remat_dist.testing import run_distributed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--moe-tokens", type=int, default=512)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    cfg = {
        k: getattr(a, k) for k in ("iters", "warmup", "seq", "dim", "layers", "batch")
    }
    cfg["moe_tokens"] = a.moe_tokens
    result = run_distributed(measure, cfg, world_size=2, timeout=1800.0)[0]
    for name, res in result.items():
        for kind in ("wall", "cpu"):
            r = res[kind]
            print(
                f"{name:5s} {kind:4s} {r['ms_none']:8.2f} ms -> {r['ms_values']:8.2f} ms   "
                f"values/none median {r['ratio_median']:.4f} (IQR {r['ratio_q1']:.4f}-"
                f"{r['ratio_q3']:.4f}, {res['pairs']} pairs)"
            )
    if a.json:
        Path(a.json).write_text(
            json.dumps({"config": cfg, "results": result}, indent=2)
        )


if __name__ == "__main__":
    main()
