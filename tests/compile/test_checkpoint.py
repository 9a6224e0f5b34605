"""``checkpoint``, ``region``, ``name_scope``, ``recompute_needs_tensor`` and
``is_recomputing`` under ``torch.compile``.

What is compared, and how exactly:

* gradients: compiled remat vs eager remat (and vs the model without remat),
  bitwise with backend ``aot_eager`` for the blocks below (``eager``: in
  test_fallback.py; the same ATen
  ops on the same data; not a general guarantee: a parameter used several times
  accumulates its gradient in another order, ~1e-7 relative, as compiled
  ``torch.utils.checkpoint`` itself does); with ``inductor`` within a relative
  ``INDUCTOR_RTOL`` of the largest gradient (fused kernels sum in another order),
  and bitwise equal to this block compiled by inductor without remat;
* bytes saved for backward: one independent counter
  (``remat_dist.testing.SavedBytesCounter``, an outermost saved-tensors hook, which
  also sees what a compiled graph saves) around both forwards: equal, except the
  generator state AOTAutograd stashes per recomputed random op (CPU attention is
  tagged random even at ``dropout_p=0``), the compiled counterpart of the state
  snapshot the eager checkpoint keeps outside autograd;
* one graph, no graph break (``fullgraph=True`` compiles, and
  ``torch._dynamo.explain`` counts).
"""

from __future__ import annotations

import pytest
import torch

import remat_dist as remat
from remat_dist._torch import TORCH_RELEASE
from remat_dist.models import Block, GPTConfig
from tests.compile._common import assert_grads_equal, fresh_dynamo, step

CFG = GPTConfig(seq_len=16, dim=32, n_heads=4, dropout=0.0)
RNG_STATE_BYTES = torch.get_rng_state().nbytes if TORCH_RELEASE < (2, 14) else 0
"""The generator state AOTAutograd stashes for the recomputed CPU attention: the
CPU generator's state on torch 2.11 to 2.13; torch 2.14 and newer stash none for
it (attention at ``dropout_p=0``)."""
INDUCTOR_RTOL = 1e-5
"""Per gradient: max |inductor - eager| <= INDUCTOR_RTOL * the largest |gradient| of
all (a gradient near zero, as a key bias's, has no scale of its own)."""


def _block(policy, cfg=CFG):
    torch.manual_seed(0)
    block = Block(cfg)
    if policy is not None:
        remat.apply_remat(torch.nn.Sequential(block), blocks=Block, policy=policy)
    return block


def _loss(y):
    return y.square().sum()


X = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))


# -- a function with every region kind --------------------------------------------


W1 = torch.randn(16, 32, generator=torch.Generator().manual_seed(1)) / 4
W2 = torch.randn(32, 16, generator=torch.Generator().manual_seed(2)) / 4


class _Regions(torch.nn.Module):
    """save region, recompute region, name_scope'd repeats, recompute_needs_tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(W1.clone())
        self.w2 = torch.nn.Parameter(W2.clone())
        self.run = remat.checkpoint(region_name="toy")(self._body)

    def _up(self, h):
        return torch.tanh(h @ self.w1.T)

    def _body(self, x):
        h = torch.sin(x)
        for i in range(2):
            with remat.name_scope(f"part{i}"):
                u = remat.region(self._up, "up", recompute=False)(h)
                remat.recompute_needs_tensor(u)
                h = h + remat.region(
                    lambda t: torch.cos(t @ self.w2.T), "down", recompute=True
                )(u)
        scale = 2.0 if remat.is_recomputing() else 1.0
        return h * scale

    def forward(self, x):
        return self.run(x)


def test_regions_fullgraph_equal_eager():
    """Save and recompute regions, name_scope, recompute_needs_tensor and
    is_recomputing trace in one graph; grads and saved bytes equal eager remat.
    (backend="eager" keeps the save regions in torch's selective-checkpoint
    storage, which the counter does not see: test_fallback.py.)"""
    fresh_dynamo()
    eager = _Regions()
    eager_bytes, eager_grads = step(eager, X, _loss)
    compiled = _Regions()
    compiled.compile(backend="aot_eager", fullgraph=True)
    got_bytes, got_grads = step(compiled, X, _loss)
    assert_grads_equal(eager_grads, got_grads)
    assert got_bytes == eager_bytes
    # eager remat keeps the input and the two save regions' outputs and saves
    assert eager_bytes < step(_Plain(), X, _loss)[0]


class _Plain(_Regions):
    def forward(self, x):
        return self._body(x)


def test_explain_one_graph_no_break():
    fresh_dynamo()
    explained = torch._dynamo.explain(_Regions())(X.clone().requires_grad_())
    assert explained.graph_count == 1, explained
    assert explained.graph_break_count == 0, explained.break_reasons


# -- the reference block ---------------------------------------------------------------


@pytest.mark.parametrize("policy", ["full", "attention-saved"])
def test_block_equals_eager_remat(policy):
    """GPT block, apply_remat then block.compile(fullgraph=True): grads bitwise equal
    eager remat and the block without remat; saved bytes equal eager remat's."""
    pol = "full" if policy == "full" else {"attention": "save"}
    fresh_dynamo()
    ref_bytes, ref = step(_block(None), X, _loss)
    eager_bytes, eager = step(_block(pol), X, _loss)
    block = _block(pol)
    block.compile(backend="aot_eager", fullgraph=True)
    got_bytes, got = step(block, X, _loss)
    assert_grads_equal(eager, got)
    assert_grads_equal(ref, got)
    # the CPU attention op is tagged random: recomputing it stashes the generator
    # state (the eager checkpoint keeps the same snapshot, outside autograd)
    stashed = RNG_STATE_BYTES if policy == "full" else 0
    assert got_bytes == eager_bytes + stashed, (got_bytes, eager_bytes)
    assert got_bytes < ref_bytes / 2


@pytest.mark.slow
def test_block_inductor_within_tolerance():
    """Inductor (CPU): grads within INDUCTOR_RTOL (relative to the largest) of eager
    remat and bitwise equal to inductor without remat; saved bytes those of eager
    remat."""
    fresh_dynamo()
    eager_bytes, eager = step(_block("full"), X, _loss)
    plain = _block(None)
    plain.compile(backend="inductor", fullgraph=True)
    _, plain_grads = step(plain, X, _loss)
    fresh_dynamo()
    block = _block("full")
    block.compile(backend="inductor", fullgraph=True)
    got_bytes, got = step(block, X, _loss)
    scale = max(ref.abs().max().item() for ref in eager.values())
    for name, ref in eager.items():
        diff = (got[name] - ref).abs().max().item()
        assert diff <= INDUCTOR_RTOL * scale, (name, diff, scale)
    assert_grads_equal(plain_grads, got)
    # inductor adds its own 16-byte seed buffer next to the stashed state
    assert 0 <= got_bytes - eager_bytes - RNG_STATE_BYTES <= 64, (
        got_bytes,
        eager_bytes,
    )


@pytest.mark.parametrize(
    "backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]
)
def test_dropout_equals_compiled_without_checkpoint(backend):
    """Dropout inside a compiled checkpoint: AOTAutograd replays the generator state
    it stashed, so grads equal the compiled block without remat bitwise."""
    cfg = GPTConfig(seq_len=16, dim=32, n_heads=4, dropout=0.3)
    results = {}
    for policy in (None, "full", {"attention": "save"}):
        fresh_dynamo()
        block = _block(policy, cfg)
        block.compile(backend=backend, fullgraph=True)
        torch.manual_seed(7)
        results[str(policy)] = step(block, X, _loss)[1]
    for grads in results.values():
        assert_grads_equal(results["None"], grads)
    if backend == "aot_eager":  # aot_eager draws like eager: equal eager remat too
        block = _block("full", cfg)
        torch.manual_seed(7)
        assert_grads_equal(step(block, X, _loss)[1], results["full"])


def test_whole_model_fullgraph():
    """The whole GPT with apply_remat compiles into one graph (apply_remat's step
    pre-hook included) and matches the model without remat bitwise."""
    from remat_dist.models import GPT, make_batch

    cfg = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=2)
    tokens, targets = make_batch(cfg, 2, seed=0)
    fresh_dynamo()
    ref, model = GPT(cfg), GPT(cfg)
    remat.apply_remat(model, blocks=Block, policy={"attention": "save"})
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.nn.functional.cross_entropy(
        compiled(tokens).flatten(0, 1), targets.flatten()
    ).backward()
    ref.loss(tokens, targets).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_replan_after_compile(caplog):
    """remove_remat + apply_remat with another policy on a compiled block: the next
    call recompiles with the new plan (apply_remat/remove_remat reset Dynamo)."""
    import logging

    from remat_dist import remove_remat

    caplog.set_level(logging.INFO, logger="remat_dist")

    expected = {}
    for policy in ("full", {"attention": "save"}, None):
        fresh_dynamo()
        expected[str(policy)] = step(_block(policy), X, _loss)[0]
    fresh_dynamo()
    block = _block(None)
    model = torch.nn.Sequential(block)
    remat.apply_remat(model, blocks=Block, policy="full")
    block.compile(backend="aot_eager", fullgraph=True)
    full_bytes = step(block, X, _loss)[0]
    assert full_bytes == expected["full"] + RNG_STATE_BYTES
    remove_remat(model)
    assert "remove_remat: 1 compiled module(s) (0)" in caplog.text
    remat.apply_remat(model, blocks=Block, policy={"attention": "save"})
    assert step(block, X, _loss)[0] == expected[str({"attention": "save"})]
    remove_remat(model)
    assert step(block, X, _loss)[0] == expected["None"]
