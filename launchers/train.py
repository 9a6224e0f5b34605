"""Train the reference GPT with FSDP2 (+ tensor parallelism) and remat, under torchrun.

    torchrun --standalone --nproc-per-node 2 launchers/train.py --steps 20
    torchrun --standalone --nproc-per-node 4 launchers/train.py --tp 2 --remat attention

CPU + gloo by default; CUDA + NCCL when GPUs are present (one device per local
rank), or with ``--device cuda``. The model learns the bundled byte-level text, so
the loss falls visibly within the demo. Rank 0 prints one line per step (loss, step
time, tokens/s); every log line is rank-prefixed. At the end: the cross-rank
saved-tensor report and each rank's peak memory (``--report-json PATH`` writes both).

Bad flags, a mesh that does not divide the world size, or ``--device cuda`` without
GPUs end every rank with a one-line error and exit code 2, before any collective.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import remat_dist as remat
from remat_dist.distributed import all_gather_objects
from remat_dist.models import GPT, Block, GPTConfig
from remat_dist.models.text import TEXT_VOCAB_SIZE, load_tiny_corpus, text_batch

REMAT_POLICIES: dict[str, Any] = {
    "full": "full",
    "attention": {"attention": "save"},
    "mlp": {"mlp": "save"},
    "every2": {"every": 2},
    "none": None,
}


@dataclass
class TrainConfig:
    """What one run trains and how (every field is a ``--flag``)."""

    steps: int = 20
    """Optimizer steps."""
    batch: int = 8
    """Sequences per rank (per data-parallel rank under TP) and step."""
    seq: int = 64
    """Tokens per sequence."""
    dim: int = 128
    """Model width."""
    heads: int = 4
    """Attention heads (divisible by --tp)."""
    layers: int = 4
    """Transformer blocks."""
    dropout: float = 0.1
    """Dropout after attention and MLP (replayed exactly by the RNG state hooks)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    seed: int = 0
    """Seed of the weights, the data order and dropout."""
    tp: int = 1
    """Tensor-parallel degree (a 2-D dp x tp mesh when > 1)."""
    sequence_parallel: bool = False
    """With --tp: shard the residual stream along the sequence inside blocks."""
    remat: str = "full"
    """Remat policy per block: full | attention | mlp | every2 | none."""
    collectives: str = "replay"
    """How collectives inside a checkpoint behave on replay: replay | save."""
    compile: bool = False
    """torch.compile each block on its own (fullgraph, as torchtitan), after remat."""
    device: str = "auto"
    """auto (CUDA + NCCL when GPUs are present) | cpu | cuda."""
    report_json: str | None = None
    """Write the cross-rank report, peak memory and losses here (rank 0)."""
    memory_budget: str | None = None
    """Activation bytes per rank (e.g. 512MiB, 2GiB): replaces --remat with a
    MemoryBudget plan measured in step 1 and applied from step 2."""


class LaunchError(Exception):
    """A configuration error every rank detects on its own, before any collective."""


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    parser = argparse.ArgumentParser(
        prog="launchers/train.py", description=__doc__.split("\n\n")[0]
    )
    docs = _field_docs()
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=docs.get(f.name))
            continue
        kind = {"int": int, "float": float}.get(str(f.type), str)
        choices = None
        if f.name == "remat":
            choices = sorted(REMAT_POLICIES)
        elif f.name == "collectives":
            choices = ["replay", "save"]
        elif f.name == "device":
            choices = ["auto", "cpu", "cuda"]
        parser.add_argument(
            flag, type=kind, default=f.default, choices=choices, help=docs.get(f.name)
        )
    ns = parser.parse_args(argv)
    return TrainConfig(**vars(ns))


def _field_docs() -> dict[str, str]:
    """Per-field docs (the string under each field) for --help."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
            docs[node.target.id] = str(nxt.value.value)
    return docs


def validate(cfg: TrainConfig, world: int) -> str:
    """Check what can be checked without a process group; returns the device type."""
    for name in ("steps", "batch", "seq", "dim", "heads", "layers", "tp"):
        if getattr(cfg, name) < 1:
            raise LaunchError(f"--{name} must be positive, got {getattr(cfg, name)}")
    if world % cfg.tp:
        raise LaunchError(
            f"--tp {cfg.tp} does not divide the world size {world}: the mesh is "
            f"(dp, tp) = ({world} / {cfg.tp}, {cfg.tp}). Use --tp among "
            f"{[d for d in range(1, world + 1) if world % d == 0]}."
        )
    if cfg.heads % cfg.tp or cfg.dim % cfg.heads:
        raise LaunchError(
            f"--heads {cfg.heads} must divide --dim {cfg.dim} and be divisible by "
            f"--tp {cfg.tp}."
        )
    if cfg.sequence_parallel and (cfg.tp == 1 or cfg.seq % cfg.tp):
        raise LaunchError(
            "--sequence-parallel needs --tp > 1 and --seq divisible by --tp."
        )
    if not 0.0 <= cfg.dropout < 1.0:
        raise LaunchError(f"--dropout must be in [0, 1), got {cfg.dropout}")
    if cfg.memory_budget is not None:
        try:
            remat.MemoryBudget(bytes=cfg.memory_budget)
        except remat.RematUsageError as e:
            raise LaunchError(f"--memory-budget: {e}") from None
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise LaunchError("--device cuda was given but no CUDA GPU is visible.")
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def log(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if "RANK" not in os.environ:
        print(
            "train.py: error: run it with torchrun, e.g. torchrun --standalone "
            "--nproc-per-node 2 launchers/train.py",
            file=sys.stderr,
        )
        return 2
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    try:
        device_type = validate(cfg, world)
    except LaunchError as e:
        print(f"[rank {rank}] train.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        dist.init_process_group("gloo")
    try:
        train(cfg, rank, world, device_type)
    finally:
        dist.destroy_process_group()
    return 0


def build(cfg: TrainConfig, world: int, device_type: str) -> tuple[GPT, Any]:
    config = GPTConfig(
        vocab_size=TEXT_VOCAB_SIZE,
        seq_len=cfg.seq,
        dim=cfg.dim,
        n_heads=cfg.heads,
        n_layers=cfg.layers,
        dropout=cfg.dropout,
        seed=cfg.seed,
    )
    if cfg.tp > 1:
        mesh = init_device_mesh(
            device_type, (world // cfg.tp, cfg.tp), mesh_dim_names=("dp", "tp")
        )
        tp_plan = remat.shard.reference_tp_plan(sequence_parallel=cfg.sequence_parallel)
    else:
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
        tp_plan = None
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else None
    model = GPT(config, device=device)
    policy = REMAT_POLICIES[cfg.remat]
    if cfg.memory_budget is not None:
        # under --compile the budget compiles each block once its plan is made
        policy = remat.MemoryBudget(
            bytes=cfg.memory_budget, compile={"fullgraph": True} if cfg.compile else False
        )
    if policy is not None:
        remat.apply_remat(model, blocks=Block, policy=policy, collectives=cfg.collectives)
    if cfg.compile and cfg.memory_budget is None:  # per block, after remat, before sharding
        for block in model.layers:
            block.compile(fullgraph=True)
    remat.shard_model(model, mesh, blocks=Block, tp_plan=tp_plan)
    return model, mesh


def peak_memory_bytes(device_type: str) -> int:
    if device_type == "cuda":
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def train(cfg: TrainConfig, rank: int, world: int, device_type: str) -> None:
    model, mesh = build(cfg, world, device_type)
    dp_rank = mesh["dp"].get_local_rank()
    corpus = load_tiny_corpus()
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    n_params = sum(p.numel() for p in model.parameters()) * 1  # local shards
    if rank == 0:
        log(
            rank,
            f"GPT {cfg.layers}x{cfg.dim}, mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}"
            f" ({device_type}, {dist.get_backend()}), remat {cfg.remat if cfg.memory_budget is None else 'budget ' + cfg.memory_budget}, collectives "
            f"{cfg.collectives}, {n_params:,} local params on rank 0",
        )
    # dropout masks differ per data-parallel rank and agree across its TP peers
    torch.manual_seed(cfg.seed * 1000 + dp_rank)
    losses = []
    tokens_per_step = cfg.batch * cfg.seq * (world // cfg.tp)
    for step in range(1, cfg.steps + 1):
        tokens, targets = text_batch(corpus, cfg.batch, cfg.seq, seed=step * 7919 + dp_rank)
        if device_type == "cuda":
            tokens, targets = tokens.cuda(), targets.cuda()
        t0 = time.perf_counter()
        loss = model.loss(tokens, targets)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.SUM)
        mean /= world
        if device_type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        losses.append(mean.item())
        if step == 1 and cfg.memory_budget is not None and rank == 0:
            log(rank, "memory budget plan (from step 2): " + remat.budget.current_plan(model).format())
        if rank == 0:
            log(
                rank,
                f"step {step}/{cfg.steps}  loss {losses[-1]:.4f}  "
                f"step {elapsed * 1e3:.0f} ms  {tokens_per_step / elapsed:,.0f} tok/s",
            )

    tokens, targets = text_batch(corpus, cfg.batch, cfg.seq, seed=dp_rank)
    if device_type == "cuda":
        tokens, targets = tokens.cuda(), targets.cuda()
    loss = model.loss(tokens, targets)
    report = remat.gather_saved_tensors_report(loss)
    loss.backward()
    optim.zero_grad(set_to_none=True)
    peaks = all_gather_objects(peak_memory_bytes(device_type))
    if rank == 0:
        print(report.format(), flush=True)
        kind = "CUDA max allocated" if device_type == "cuda" else "process peak RSS"
        for r, p in enumerate(peaks):
            log(rank, f"peak memory of rank {r}: {p / 2**20:.1f} MiB ({kind})")
        if cfg.report_json:
            with open(cfg.report_json, "w") as f:
                json.dump(
                    {
                        "config": dataclasses.asdict(cfg),
                        "saved_tensors": report.to_dict(),
                        "peak_memory_bytes": peaks,
                        "peak_memory_kind": kind,
                        "losses": losses,
                        "memory_budget_plan": (
                            None if cfg.memory_budget is None
                            else dataclasses.asdict(remat.budget.current_plan(model))
                        ),
                    },
                    f,
                    indent=2,
                )
            log(rank, f"wrote {cfg.report_json}")


if __name__ == "__main__":
    code = main()
    # The job is done and the group destroyed: leave without finalizing the
    # interpreter. Under load, a MemoryBudget run aborted at finalization in 2 of 6
    # CI suite runs ("terminate called without an active exception", a C++ thread
    # that still needs the GIL); it did not reproduce in 58 runs outside the suite,
    # so its cause is not found yet (docs/distributed.md, what is not covered).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
