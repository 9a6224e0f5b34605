"""One rank of a multi-host test: ``python -m tests.multihost._worker SCENARIO OUT_DIR
[OPTIONS_JSON]``, started on a simulated host (``tests.multihost._netns``) by the
test itself or by a torchrun agent there.

The rank joins the job as any training script does: ``init_process_group("gloo")``
from the environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``;
``GLOO_SOCKET_IFNAME`` for gloo's own links). It runs the scenario, which compares
the run with remat against the same model without remat in this very process, and
writes ``OUT_DIR/rank<R>.json`` whatever happened: ``finished`` (the scenario
returned), its results (those of the parts before an error too), the error's
type, text and traceback, timings, and where it ran (host name, what ``MASTER_ADDR`` resolves to there). It exits 1 when
the scenario raised (as an uncaught error ends a torchrun worker).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import remat_dist as remat
from remat_dist.models import GPT, Block, GPTConfig, GPTStage, block_tp_plan, make_batch

CONFIG = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=3)
"""The reference GPT of the TP and HSDP scenarios (test_faults' size)."""
PP_CONFIG = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=4)
STEPS = 2
"""Optimizer steps per comparison (SGD): the second step runs on updated weights."""
REPLAY_TIMEOUT_S = 10.0
"""The bound of every rank (``remat.distributed.set_replay_timeout``) unless the test says
otherwise: half the default, so that a failure costs the suite less."""


# -- helpers ----------------------------------------------------------------------


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return getattr(t, "_local_tensor", t).detach().clone()


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: _local(p.grad) for n, p in model.named_parameters()}


def _mismatches(
    ref: dict[str, torch.Tensor | None], got: dict[str, torch.Tensor | None]
) -> list[str]:
    """Names whose tensors are not bitwise equal (or present on one side only)."""
    out = sorted(set(ref) ^ set(got))
    for name in sorted(set(ref) & set(got)):
        a, b = ref[name], got[name]
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
            out.append(name)
    return out


def _stats() -> dict[str, int]:
    return dict(vars(remat.distributed.step_stats()))


def _stats_delta(before: dict[str, int]) -> dict[str, int]:
    after = _stats()
    return {k: after[k] - before.get(k, 0) for k in after}


class BackwardCollectives:
    """Counts, by ``c10d`` op, the collectives this rank issues while a backward
    runs (replays included): remat's replays re-issue the forward's collectives."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def on_collective(self, call: Any, issue: Callable[[], Any]) -> Any:
        if torch._C._current_graph_task_id() != -1:
            self.counts[call.op] = self.counts.get(call.op, 0) + 1
        return issue()


def _counting(counter: BackwardCollectives):
    from remat_dist.distributed._collectives import observe_collectives

    return observe_collectives(counter)


def _train(
    out: dict[str, Any],
    build: Callable[[Any], nn.Module],
    step: Callable[[nn.Module, int], torch.Tensor],
    policies: tuple[Any, Any] = (None, "full"),
) -> None:
    """``STEPS`` SGD steps of ``build(policy)`` for each policy; losses and the
    gradients of every step compared bitwise, the second policy against the first;
    the collectives issued in the backwards, by policy. Into ``out``, as it goes:
    ``completed`` lists the runs that finished ("none" first: a failure of the
    remat run alone shows that torch's own collectives worked)."""
    runs, counted = [], {}
    out["completed"] = []
    for policy in policies:
        model = build(policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, grads = [], []
        counter = BackwardCollectives()
        for i in range(STEPS):
            opt.zero_grad(set_to_none=True)
            with _counting(counter):
                loss = step(model, i)
                loss.backward()
            losses.append(loss.detach().clone())
            grads.append(_grads(model))
            opt.step()
        runs.append((losses, grads))
        counted["none" if policy is None else "remat"] = counter.counts
        out["completed"].append("none" if policy is None else "remat")
    (ref_losses, ref_grads), (losses, grads) = runs
    out["losses"] = [float(x) for x in losses]
    out["loss_equal"] = all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    out["grad_mismatches"] = sorted(
        {n for a, b in zip(ref_grads, grads) for n in _mismatches(a, b)}
    )
    out["n_grads"] = len(grads[0])
    out["backward_collectives"] = counted


# -- TP across hosts (and its divergence) -----------------------------------------


def _gpt(mesh, policy, *, tp_plan=None) -> GPT:
    model = GPT(CONFIG)
    if policy is not None:
        remat.apply_remat(model, blocks=Block, policy=policy)
    remat.shard_model(model, mesh, blocks=Block, tp_plan=tp_plan)
    return model


def _gpt_step(model: nn.Module, i: int, seed: int = 5) -> torch.Tensor:
    tokens, targets = make_batch(CONFIG, 4, seed=seed + 1000 * i)
    return model.loss(tokens, targets)


def scenario_tp(opts: dict[str, Any], out: dict[str, Any]) -> None:
    """TP over every rank (a 1-D mesh): remat "full" vs no remat, bitwise."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    before = _stats()
    _train(out, lambda p: _gpt(mesh, p, tp_plan=remat.shard.reference_tp_plan()), _gpt_step)
    out["stats"] = _stats_delta(before)


def scenario_tp_divergence(opts: dict[str, Any], out: dict[str, Any]) -> None:
    """TP across hosts, one divergence (``opts["kind"]``) on rank 1:

    * ``"plan"``: rank 1 keeps its blocks' attention (``{"attention": "save"}``)
      while rank 0 recomputes everything: a plan mismatch;
    * ``"replay_raises"``: rank 1's replay of block 1 raises in its MLP;
    * ``"unreachable"``: rank 0's gloo for the agreement uses an interface that
      does not join the hosts (``GLOO_SOCKET_IFNAME`` set, after the job's own
      groups were made, to a fresh veth whose subnet the other host has no route
      to; its address sorts below the hosts' so that in gloo's pairs this rank
      listens there and the other dials it): the stake's group cannot be set up.

    Every rank must raise the documented error within the bound; then a clean
    step (fresh models, remat vs none) must be bitwise equal on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    plan = remat.shard.reference_tp_plan()
    kind = opts["kind"]
    policy = {"attention": "save"} if (kind == "plan" and rank == 1) else "full"
    model = _gpt(mesh, policy, tp_plan=plan)
    if kind == "replay_raises" and rank == 1:

        def boom(module, args):
            if remat.is_recomputing():
                raise ValueError("injected replay failure on rank 1")

        model.layers[1].mlp.register_forward_pre_hook(boom)
    loss = _gpt_step(model, 0)
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if kind == "unreachable" and rank == 0:
        import subprocess

        for cmd in (
            "ip link add rdx0 type veth peer name rdx1",
            "ip addr add 10.9.0.1/24 dev rdx0",
            "ip link set rdx0 up",
            "ip link set rdx1 up",
        ):
            subprocess.run(cmd.split(), check=True, timeout=10)
        os.environ["GLOO_SOCKET_IFNAME"] = "rdx0"
    t0 = time.perf_counter()
    try:
        loss.backward()
        out["divergence"] = {
            "type": None,
            "text": "",
            "seconds": time.perf_counter() - t0,
        }
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["divergence"] = {
            "type": type(exc).__name__,
            "documented": isinstance(
                exc,
                remat.errors.PlanMismatchError
                | remat.errors.CollectiveReplayError
                | remat.errors.AgreementSetupError,
            ),
            "text": str(exc),
            "seconds": time.perf_counter() - t0,
        }
    finally:
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    # the next clean step, on every rank
    out["clean"] = {}
    _train(out["clean"], lambda p: _gpt(mesh, p, tp_plan=plan), _gpt_step)


# -- HSDP: replicate across hosts, shard within ------------------------------------


def scenario_hsdp(opts: dict[str, Any], out: dict[str, Any]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    hosts, per_host = opts["mesh"]
    mesh = init_device_mesh(
        "cpu", (hosts, per_host), mesh_dim_names=("replicate", "shard")
    )
    seed = 100 + dist.get_rank()  # data parallel: each rank its own batch
    before = _stats()
    out["replicate_group"] = dist.get_process_group_ranks(mesh["replicate"].get_group())
    out["shard_group"] = dist.get_process_group_ranks(mesh["shard"].get_group())
    _train(out, lambda p: _gpt(mesh, p), lambda m, i: _gpt_step(m, i, seed=seed))
    out["stats"] = _stats_delta(before)


# -- MoE: expert parallelism over all_to_all across hosts --------------------------


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with its transpose as the backward."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(
            back, grad.contiguous(), in_splits, out_splits, group=ctx.group
        )
        return back, None, None, None


MOE_DIM, MOE_TOKENS = 16, 24


class MoELayer(nn.Module):
    """Top-1 routing over one expert per rank of ``group``: the token counts are
    exchanged (``all_to_all_single``), then the tokens themselves (uneven
    splits), the expert runs, and the results come back the same way."""

    def __init__(self, group, layer: int) -> None:
        super().__init__()
        self.group = group
        n = dist.get_world_size(group)
        me = dist.get_rank(group)
        g = torch.Generator().manual_seed(10 * layer)
        self.norm = nn.LayerNorm(MOE_DIM)
        self.router = nn.Parameter(torch.randn(MOE_DIM, n, generator=g) / 4)
        g.manual_seed(10 * layer + 1 + me)  # this rank's own expert
        self.w1 = nn.Parameter(torch.randn(MOE_DIM, 2 * MOE_DIM, generator=g) / 4)
        self.w2 = nn.Parameter(torch.randn(2 * MOE_DIM, MOE_DIM, generator=g) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = dist.get_world_size(self.group)
        h = self.norm(x)
        probs = (h @ self.router).softmax(-1)
        gate, choice = probs.max(-1)
        order = choice.argsort(stable=True)
        counts = torch.bincount(choice, minlength=n)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send_splits, recv_splits = counts.tolist(), recv_counts.tolist()
        send = h[order] * gate[order, None]
        recv = _AllToAll.apply(send, recv_splits, send_splits, self.group)
        y = torch.nn.functional.gelu(recv @ self.w1) @ self.w2
        back = _AllToAll.apply(y, send_splits, recv_splits, self.group)
        return x + torch.zeros_like(back).index_copy(0, order, back)


class MoEModel(nn.Module):
    def __init__(self, group, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoELayer(group, i) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def scenario_moe(opts: dict[str, Any], out: dict[str, Any]) -> None:
    group = dist.new_group(list(range(dist.get_world_size())))  # the EP group

    def build(policy):
        model = MoEModel(group)
        if policy is not None:
            remat.apply_remat(model, blocks=MoELayer, policy=policy)
        return model

    def step(model, i):
        g = torch.Generator().manual_seed(1000 * i + dist.get_rank())
        x = torch.randn(MOE_TOKENS, MOE_DIM, generator=g)
        return (model(x) ** 2).mean()

    before = _stats()
    _train(out, build, step)
    out["stats"] = _stats_delta(before)
    # the routing really sends tokens both ways across the group
    model = MoEModel(group)
    x = torch.randn(
        MOE_TOKENS, MOE_DIM, generator=torch.Generator().manual_seed(dist.get_rank())
    )
    choice = (model.layers[0].norm(x) @ model.layers[0].router).argmax(-1)
    out["tokens_per_expert"] = torch.bincount(
        choice, minlength=dist.get_world_size()
    ).tolist()


# -- PP x TP ---------------------------------------------------------------------


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def scenario_pp_tp(opts: dict[str, Any], out: dict[str, Any]) -> None:
    """2 pipeline stages x TP 2 (mesh ("pp", "tp") over ``opts["mesh_ranks"]``),
    Schedule1F1B, 4 micro-batches: losses and gradients of both steps, remat
    ("full" on stage 0, attention kept on stage 1) vs none, bitwise."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = DeviceMesh(
        "cpu", torch.tensor(opts["mesh_ranks"]), mesh_dim_names=("pp", "tp")
    )
    pp, tp = mesh["pp"], mesh["tp"]
    stage, n_stages = pp.get_local_rank(), 2
    per = PP_CONFIG.n_layers // n_stages
    layer_ids = list(range(stage * per, (stage + 1) * per))

    def run(policy) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor | None]]]:
        module = GPTStage(
            GPT(PP_CONFIG), layer_ids, first=stage == 0, last=stage == n_stages - 1
        )
        for block in module.layers.values():
            parallelize_module(block, tp, block_tp_plan())
        if policy is not None:
            remat.apply_remat(module, blocks=Block, policy=policy[stage])
        pstage = PipelineStage(
            module, stage, n_stages, torch.device("cpu"), group=pp.get_group()
        )
        schedule = Schedule1F1B(pstage, n_microbatches=4, loss_fn=_ce)
        losses_out, grads = [], []
        counter = BackwardCollectives()
        for i in range(STEPS):
            module.zero_grad(set_to_none=True)
            tokens, targets = make_batch(PP_CONFIG, 8, seed=100 + 10 * i)
            losses: list[torch.Tensor] = []
            kwargs = (
                {"target": targets, "losses": losses} if stage == n_stages - 1 else {}
            )
            with _counting(counter):
                if stage == 0:
                    schedule.step(tokens, **kwargs)
                else:
                    schedule.step(**kwargs)
            losses_out.append(
                torch.stack(losses).detach().clone() if losses else torch.empty(0)
            )
            grads.append(_grads(module))
        counted["none" if policy is None else "remat"] = counter.counts
        out["completed"].append("none" if policy is None else "remat")
        return losses_out, grads

    out["stage"] = stage
    out["tp_group"] = dist.get_process_group_ranks(tp.get_group())
    out["pp_group"] = dist.get_process_group_ranks(pp.get_group())
    counted: dict[str, dict[str, int]] = {}
    out["completed"] = []
    before = _stats()
    ref_losses, ref_grads = run(None)
    losses, grads = run(("full", {"attention": "save"}))
    out.update(
        {
            "losses": [x.tolist() for x in losses],
            "loss_equal": all(torch.equal(a, b) for a, b in zip(ref_losses, losses)),
            "grad_mismatches": sorted(
                {n for a, b in zip(ref_grads, grads) for n in _mismatches(a, b)}
            ),
            "n_grads": len(grads[0]),
            "backward_collectives": counted,
            "stats": _stats_delta(before),
        }
    )


SCENARIOS: dict[str, Callable[[dict[str, Any], dict[str, Any]], None]] = {
    "tp": scenario_tp,
    "tp_divergence": scenario_tp_divergence,
    "hsdp": scenario_hsdp,
    "moe": scenario_moe,
    "pp_tp": scenario_pp_tp,
}


def _resolve(name: str) -> str | None:
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None


def main() -> int:
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    opts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    master = os.environ.get("MASTER_ADDR", "")
    report: dict[str, Any] = {
        "rank": rank,
        "scenario": scenario,
        "hostname": socket.gethostname(),
        "master_addr": master,
        "master_addr_resolves_to": _resolve(master),
        "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "finished": False,
    }
    t0 = time.perf_counter()
    code = 1
    try:
        dist.init_process_group(
            "gloo", timeout=timedelta(seconds=float(opts.get("pg_timeout", 45)))
        )
        report["init_seconds"] = time.perf_counter() - t0
        remat.distributed.set_replay_timeout(float(opts.get("replay_timeout", REPLAY_TIMEOUT_S)))
        # filled as the scenario goes: a part that failed leaves the parts before
        report["result"] = {}
        SCENARIOS[scenario](opts, report["result"])
        report["finished"] = True
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        report["error_type"] = type(exc).__name__
        report["error"] = str(exc)
        report["traceback"] = traceback.format_exc()
    report["seconds"] = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.rename(out_dir / f"rank{rank}.json")
    if code == 0 and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # a rank whose peers failed may hold a gloo pair in a dead state: exit at once
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
