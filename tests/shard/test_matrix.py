"""The equivalence matrix: the reference GPT (dim 32, 2 layers, seq 16, dropout 0.1)
trained 3 optimizer steps (SGD, momentum) with remat equals it without remat, on 1
rank (no process group), 2 ranks FSDP2, 2 ranks TP, 2 ranks TP + sequence parallel
and 4 ranks FSDP2 x TP (2 x 2); policies full and attention-saved;
``reshard_after_forward`` True and False.

What is compared, and how exactly:

* remat vs no remat, same layout: gradients, parameters and losses **bitwise** (the
  replay recomputes the very same ops on the very same data), module types and
  ``state_dict`` keys equal.
* both orders: "full" runs apply remat before ``shard_model``, attention-saved
  runs with ``reshard_after_forward=False`` (TP-only layouts: the attention-saved
  run) apply it after; each equals the same baseline bitwise.
* data: the ``reshard_after_forward=True`` runs give every rank the same batch (so
  they can be compared with one process); the False runs give each data-parallel
  rank its own. The 2 x 2 layout runs plain TP with True and TP + sequence
  parallel with False.
* the sharded runs vs a single-process run of the same model on the same batch:
  - FSDP2: **bitwise** (all-gathers copy; the reduce-scatter averages identical
    values over 2 ranks, which is exact);
  - TP, TP + SP, FSDP2 x TP: ``rtol=1e-4, atol=1e-6`` (measured max abs diff
    4e-8): row-wise layers sum partial products across ranks, in another order
    than one matmul does.
  - TP + SP draws each rank's dropout mask for its own sequence shard, so with
    dropout it cannot match one process; it is compared at dropout 0 instead.
* FSDP2 parameter all-gathers issued during backward: remat adds none (counted by
  an observer of the collectives the training step issues, nothing patched).
* the checkpoints really recompute: MLP calls double, a saved attention's body
  runs once.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from remat_dist import apply_remat, shard_model
from remat_dist.distributed._collectives import CollectiveCall, observe_collectives
from remat_dist.models import GPT, MLP, Attention, Block, GPTConfig, make_batch
from remat_dist.shard import reference_tp_plan
from remat_dist.testing import dist_context, run_distributed
from remat_dist.testing.equivalence import (
    TrainResult,
    compare_results,
    train_steps,
)
from tests.wrap._rng import cpu_hooks

CFG = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=2, dropout=0.1)
STEPS = 3
POLICIES = {"full": "full", "attention-saved": {"attention": "save"}}
TP_TOL = {"rtol": 1e-4, "atol": 1e-6}


def optimizer(params):
    return torch.optim.SGD(list(params), lr=0.05, momentum=0.9)


def gpt_loss(model, batch):
    return model.loss(*batch)


# -- counting --------------------------------------------------------------------

# The c10d ops of FSDP2's parameter all-gather (``dist.all_gather_single``) and of
# the functional collectives DTensor's TP redistributions issue.
_FSDP_ALL_GATHER = "_allgather_base_"
_TP_OPS = {
    "allgather_into_tensor_coalesced_",
    "reduce_scatter_tensor_coalesced_",
    "allreduce_",
    "alltoall_base_",
}


class _BackwardCollectives:
    """Counts the collectives issued during backward, by kind."""

    def __init__(self) -> None:
        self.fsdp_all_gathers = 0
        self.tp_collectives = 0

    def on_collective(self, call: CollectiveCall, issue: Callable[[], Any]) -> Any:
        if torch._C._current_graph_task_id() != -1:
            if call.op == _FSDP_ALL_GATHER:
                self.fsdp_all_gathers += 1
            elif call.op in _TP_OPS:
                self.tp_collectives += 1
        return issue()


def _count_calls(model) -> dict[str, int]:
    counts = {"attention_body": 0, "mlp": 0}
    for module in model.modules():
        if isinstance(module, Attention):
            module.wq.register_forward_pre_hook(
                lambda *_: counts.__setitem__(
                    "attention_body", counts["attention_body"] + 1
                )
            )
        if isinstance(module, MLP):
            module.register_forward_pre_hook(
                lambda *_: counts.__setitem__("mlp", counts["mlp"] + 1)
            )
    return counts


# -- one training run ---------------------------------------------------------------


@dataclasses.dataclass
class Run:
    result: TrainResult
    model: Any
    fsdp_all_gathers: int
    tp_collectives: int
    calls: dict[str, int]


def train(
    cfg: GPTConfig,
    batch,
    *,
    mesh=None,
    tp_plan=None,
    policy=None,
    reshard: bool = True,
    remat_first: bool = True,
) -> Run:
    torch.manual_seed(0)
    model = GPT(cfg)

    def remat() -> None:
        if policy is not None:
            apply_remat(model, blocks=Block, policy=policy, recompute_state_hooks=cpu_hooks())

    if remat_first:
        remat()
    if mesh is not None:
        shard_model(
            model, mesh, blocks=Block, tp_plan=tp_plan, reshard_after_forward=reshard
        )
    if not remat_first:
        remat()
    calls = _count_calls(model)
    counted = _BackwardCollectives()
    with observe_collectives(counted):
        result = train_steps(
            model, batch, steps=STEPS, loss_fn=gpt_loss, make_optimizer=optimizer
        )
    return Run(
        result,
        model,
        counted.fsdp_all_gathers,
        counted.tp_collectives,
        dict(calls),
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def full_result(run: Run) -> TrainResult:
    """The run's parameters and gradients as full tensors (a collective)."""
    params = {n: _full(p).clone() for n, p in run.model.named_parameters()}
    grads = {
        n: None if p.grad is None else _full(p.grad).clone()
        for n, p in run.model.named_parameters()
    }
    return TrainResult(run.result.losses, grads, params)


def assert_same(ref: TrainResult, other: TrainResult, what: str, **tol: float) -> float:
    mismatches, gmax, pmax = compare_results(ref, other, **tol)
    assert not mismatches, f"{what}: " + "; ".join(
        f"{m.what} {m.name}: {m.detail}" for m in mismatches[:6]
    )
    return max(gmax, pmax)


# -- the matrix body (runs on every rank) -----------------------------------------------

LAYOUTS = {
    # name: (world_size, mesh_shape, mesh_dim_names,
    #        TP sequence_parallel for the reshard_after_forward=(True, False) runs)
    "fsdp2": (2, (2,), ("dp",), (None, None)),
    "tp": (2, (2,), ("tp",), (False,)),
    "tp_sp": (2, (2,), ("tp",), (True,)),
    # 2 x 2: plain TP with reshard_after_forward=True (compared with one process),
    # TP + sequence parallel with False (each dp rank its own data).
    "fsdp2xtp": (4, (2, 2), ("dp", "tp"), (False, True)),
}


def matrix_body(layout: str) -> dict[str, Any]:
    # A view returned from an FSDP block loses its pre-backward hook to in-place ops
    # (shard_model's sequence-parallel output gather must not return one).
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*returned a view tensor.*")
        return _matrix(layout)


def _matrix(layout: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    _, _, names, sps = LAYOUTS[layout]
    mesh = dist_context().mesh
    fsdp = "dp" in names
    plans = [
        None if sp is None else reference_tp_plan(sequence_parallel=sp) for sp in sps
    ]
    same_batch = make_batch(CFG, 2, seed=0)
    summary: dict[str, Any] = {"all_gathers": {}, "tp_collectives": {}}
    baselines = {}
    for i, plan in enumerate(plans):
        reshard = i == 0
        # reshard_after_forward=False runs give each data-parallel rank its own
        # data; the True runs share one batch so they can match one process.
        batch = same_batch
        if fsdp and not reshard:
            dp_rank = mesh["dp"].get_local_rank() if mesh.ndim > 1 else dist.get_rank()
            batch = make_batch(CFG, 2, seed=100 + dp_rank)
        base = train(CFG, batch, mesh=mesh, tp_plan=plan, reshard=reshard)
        baselines[reshard] = base
        key = f"reshard={reshard}" if fsdp else "-"
        if len(set(sps)) > 1:
            key += " sp" if sps[i] else " tp"
        summary["all_gathers"][f"{key} none"] = base.fsdp_all_gathers
        summary["tp_collectives"][f"{key} none"] = base.tp_collectives
        for pname, policy in POLICIES.items():
            # Both orders: remat then shard for "full"; shard then remat for the
            # attention-saved runs (first reshard setting) -- each must equal the
            # same no-remat baseline bitwise.
            remat_first = pname == "full" or not reshard
            run = train(
                CFG,
                batch,
                mesh=mesh,
                tp_plan=plan,
                policy=policy,
                reshard=reshard,
                remat_first=remat_first,
            )
            order = "remat->shard" if remat_first else "shard->remat"
            assert_same(base.result, run.result, f"{layout} {key} {pname} {order}")
            assert run.result.structure == base.result.structure
            assert run.result.state_dict_keys == base.result.state_dict_keys
            # Remat adds no FSDP all-gather in backward.
            assert run.fsdp_all_gathers == base.fsdp_all_gathers, (
                run.fsdp_all_gathers,
                base.fsdp_all_gathers,
            )
            # ...and really recomputed: the MLPs ran again in backward; a saved
            # attention's body did not.
            assert run.calls["mlp"] == 2 * base.calls["mlp"]
            factor = 2 if pname == "full" else 1
            assert run.calls["attention_body"] == factor * base.calls["attention_body"]
            summary["all_gathers"][f"{key} {pname}"] = run.fsdp_all_gathers
            summary["tp_collectives"][f"{key} {pname}"] = run.tp_collectives
    if fsdp:
        assert baselines[True].fsdp_all_gathers > 0
        assert baselines[False].fsdp_all_gathers == 0

    # Against one process on the same batch. Remat runs equal the baselines
    # bitwise (above), so they match one process exactly as well as these do.
    plan = plans[0]
    if sps[0]:
        # Per-shard dropout masks differ from one process: compare at dropout 0.
        cfg0 = dataclasses.replace(CFG, dropout=0.0)
        ref = train(cfg0, same_batch).result
        got = full_result(
            train(cfg0, same_batch, mesh=mesh, tp_plan=plan, policy="full")
        )
        what = "dropout 0, full remat"
    else:
        ref = train(CFG, same_batch).result
        got = full_result(baselines[True])
        what = "no remat"
    tol = TP_TOL if plan is not None else {}
    summary["vs_single"] = (what, assert_same(ref, got, f"{layout} vs single", **tol))
    summary["seconds"] = time.perf_counter() - t0
    return summary


def _report(layout: str, results: list[dict[str, Any]]) -> None:
    r0 = results[0]
    print(
        f"\n[{layout}] {r0['seconds']:.2f} s on the ranks; backward FSDP all-gathers "
        f"{r0['all_gathers']}; backward TP collectives {r0['tp_collectives']}; "
        f"vs single process ({r0['vs_single'][0]}) max abs diff {r0['vs_single'][1]:.2e}"
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matrix(layout):
    world_size, shape, names, _ = LAYOUTS[layout]
    results = run_distributed(
        matrix_body,
        layout,
        world_size=world_size,
        mesh_shape=shape,
        mesh_dim_names=names,
        timeout=120,
    )
    _report(layout, results)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_matrix_single_process(policy):
    """1 rank, no process group: remat vs none, bitwise (dropout on)."""
    batch = make_batch(CFG, 2, seed=0)
    base = train(CFG, batch)
    run = train(CFG, batch, policy=POLICIES[policy])
    assert_same(base.result, run.result, f"1 rank {policy}")
    assert run.calls["mlp"] == 2 * base.calls["mlp"]
    assert run.result.state_dict_keys == base.result.state_dict_keys
