"""Per-block compile as torchtitan does it, on 2 real gloo ranks.

``apply_remat`` first, then ``block.compile(fullgraph=True)`` on every block, then
``shard_model`` (FSDP2, or TP): the gradients equal the same compiled model without
remat bitwise (backend ``aot_eager``: the same ATen ops on the same data), and the
collectives issued in backward, counted by kind by an observer of every ``c10d::``
op, equal those of the compiled model without remat: the partitioner recomputes no
collective (a TP block's all-reduces are pinned ``MUST_SAVE``) and remat adds no
FSDP all-gather.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from remat_dist import apply_remat, shard_model
from remat_dist._torch import TORCH_RELEASE
from remat_dist.distributed._collectives import CollectiveCall, observe_collectives
from remat_dist.models import GPT, Block, GPTConfig, make_batch
from remat_dist.shard import reference_tp_plan
from remat_dist.testing import SavedBytesCounter, dist_context, run_distributed
from tests.compile._common import fresh_dynamo

CFG = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=1, dropout=0.1)
POLICIES = {"full": "full", "attention-saved": {"attention": "save"}}


class _BackwardCollectives:
    """Counts the collectives issued during backward, by ``c10d::`` op name."""

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()

    def on_collective(self, call: CollectiveCall, issue: Any) -> Any:
        if torch._C._current_graph_task_id() != -1:
            self.ops[call.op] += 1
        return issue()


GENERATOR_STATE_BYTES = torch.get_rng_state().nbytes
REPLAYED_RANDOM_OPS_TP = (
    {"full": 3, "attention-saved": 1} if TORCH_RELEASE < (2, 12) else {}
)
"""Random ops of a compiled TP block that AOTAutograd replays from a stashed CPU
generator state, per policy. torch 2.11's Dynamo bakes the ``DeviceMesh`` into the
block's graph, so they are replayed as in any block: the attention (random on the
CPU at ``dropout_p=0`` up to 2.13) and the two dropouts under full recompute, the
MLP's dropout with the attention saved. From 2.12 the graph takes the mesh as an
input, and remat_dist keeps a random op's output there instead (``_compile``'s
``_has_opaque_inputs``): no state is stashed."""


class _SavedAndStashed(SavedBytesCounter):
    """Also counts the CPU generator states packed (``GENERATOR_STATE_BYTES`` of
    uint8)."""

    def __init__(self, parameters: Any) -> None:
        super().__init__(parameters)
        self.stashed: set[int] = set()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.dtype == torch.uint8 and storage.nbytes() == GENERATOR_STATE_BYTES:
            self.stashed.add(storage._cdata)
        return super()._pack(t)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _run(layout: str, policy: Any, batch: Any) -> tuple[dict[str, torch.Tensor], dict]:
    fresh_dynamo()
    mesh = dist_context().mesh
    torch.manual_seed(0)
    model = GPT(CFG)
    if policy is not None:
        apply_remat(model, blocks=Block, policy=policy)
    for block in model.layers:
        block.compile(backend="aot_eager", fullgraph=True)
    plan = reference_tp_plan() if layout == "tp" else None
    shard_model(model, mesh, blocks=Block, tp_plan=plan)
    counted = _BackwardCollectives()
    torch.manual_seed(1)  # the same dropout masks in every run
    with observe_collectives(counted):
        with _SavedAndStashed(model.parameters()) as saved:
            loss = model.loss(*batch)
        loss.backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    grads["loss"] = loss.detach()
    stashed = len(saved.stashed)
    return grads, {
        "ops": dict(counted.ops),
        "saved": saved.activation_bytes - stashed * GENERATOR_STATE_BYTES,
        "stashed": stashed,
    }


def per_block_body(layout: str) -> dict[str, Any]:
    batch = make_batch(CFG, 2, seed=0)
    base, base_seen = _run(layout, None, batch)
    out: dict[str, Any] = {"none": base_seen["ops"]}
    saved: dict[str, int] = {}
    stashed: dict[str, int] = {}
    for name, policy in POLICIES.items():
        grads, seen = _run(layout, policy, batch)
        for key, ref in base.items():
            assert torch.equal(grads[key], ref), (name, key, (grads[key] - ref).abs().max())
        assert seen["ops"] == base_seen["ops"], (name, seen, base_seen)
        out[name] = seen["ops"]
        saved[name] = seen["saved"]
        if seen["stashed"]:
            stashed[name] = seen["stashed"]
    # the compiled blocks really checkpoint, and the saved attention is kept;
    # generator states are left out: one (5,056 bytes) per replayed random op
    # outweighs the activations of a block this small
    assert saved["full"] < saved["attention-saved"] < base_seen["saved"], saved
    assert base_seen["stashed"] == 0
    if layout == "tp":
        assert stashed == REPLAYED_RANDOM_OPS_TP, stashed
    return out


@pytest.mark.parametrize(
    "layout",
    [
        "fsdp2",
        "tp",
    ],
)
def test_per_block_compile(layout):
    names = ("dp",) if layout == "fsdp2" else ("tp",)
    results = run_distributed(
        per_block_body, layout, world_size=2, mesh_shape=(2,), mesh_dim_names=names,
        timeout=240,
    )
    ops = results[0]
    if layout == "fsdp2":
        assert ops["none"].get("_reduce_scatter_base_", 0) > 0
    else:
        assert sum(ops["none"].values()) > 0  # TP backward all-reduces
    print(f"\n[{layout}] backward collectives per policy: {ops}")
