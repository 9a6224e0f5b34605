"""The reference GPT (single process)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from remat_dist.models import GPT, Attention, Block, GPTConfig, make_batch

SMALL = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=2)


def test_same_config_same_weights_whatever_the_global_rng() -> None:
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = GPT(SMALL)
    assert torch.equal(torch.get_rng_state(), state), "construction drew global RNG"
    torch.manual_seed(999)
    b = GPT(SMALL)
    for (name, pa), (_, pb) in zip(
        a.named_parameters(), b.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
    c = GPT(GPTConfig(**{**vars(SMALL), "seed": 1}))
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_init_weights_reproduces_construction() -> None:
    model = GPT(SMALL)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.init_weights()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_initial_values_follow_the_recipe() -> None:
    model = GPT(GPTConfig(dim=64, n_heads=4, n_layers=4))
    block = model.layers[0]
    assert torch.equal(block.ln1.weight, torch.ones(64))
    assert torch.equal(block.attention.wq.bias, torch.zeros(64))
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 0.002
    residual = 0.02 / math.sqrt(2 * 4)
    assert abs(block.mlp.w2.weight.std().item() - residual) < 0.1 * residual


def test_module_names_for_wrapping_and_tp_plans() -> None:
    model = GPT(SMALL)
    assert isinstance(model.layers, nn.ModuleList)
    names = dict(model.named_modules())
    for i in range(SMALL.n_layers):
        assert isinstance(names[f"layers.{i}"], Block)
        for leaf in ("wq", "wk", "wv", "wo"):
            assert isinstance(names[f"layers.{i}.attention.{leaf}"], nn.Linear)
        for leaf in ("w1", "w2"):
            assert isinstance(names[f"layers.{i}.mlp.{leaf}"], nn.Linear)
    assert names["layers.0.mlp.w1"].out_features == int(SMALL.dim * SMALL.mlp_ratio)


def test_forward_shapes_and_initial_loss() -> None:
    model = GPT(SMALL)
    tokens, targets = make_batch(SMALL, 3, seed=0)
    logits = model(tokens)
    assert logits.shape == (3, SMALL.seq_len, SMALL.vocab_size)
    loss = model.loss(tokens, targets)
    assert abs(loss.item() - math.log(SMALL.vocab_size)) < 0.3
    assert model(tokens[:, :5]).shape == (3, 5, SMALL.vocab_size)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, SMALL.seq_len + 1, dtype=torch.long))


def test_attention_is_causal() -> None:
    model = GPT(SMALL).eval()
    tokens, _ = make_batch(SMALL, 1, seed=0)
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % SMALL.vocab_size
    a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_attention_reads_head_count_from_local_width() -> None:
    """Half the heads (as a 2-way tensor-parallel shard holds them) give half the
    output: the shards' outputs sum to the full attention's."""
    torch.manual_seed(0)
    cfg = GPTConfig(dim=32, n_heads=4, bias=False)
    full = Attention(cfg)
    x = torch.randn(2, 8, 32)
    shards = []
    for part in range(2):
        shard = Attention(cfg)
        rows = slice(16 * part, 16 * (part + 1))
        with torch.no_grad():
            shard.wq = nn.Linear(32, 16, bias=False)
            shard.wk = nn.Linear(32, 16, bias=False)
            shard.wv = nn.Linear(32, 16, bias=False)
            shard.wo = nn.Linear(16, 32, bias=False)
            shard.wq.weight.copy_(full.wq.weight[rows])
            shard.wk.weight.copy_(full.wk.weight[rows])
            shard.wv.weight.copy_(full.wv.weight[rows])
            shard.wo.weight.copy_(full.wo.weight[:, rows])
        shards.append(shard(x))
    torch.testing.assert_close(shards[0] + shards[1], full(x))


def test_dropout_is_used_in_training_only() -> None:
    cfg = GPTConfig(**{**vars(SMALL), "dropout": 0.5})
    model = GPT(cfg)
    tokens, _ = make_batch(cfg, 2, seed=0)
    torch.manual_seed(0)
    a = model(tokens)
    torch.manual_seed(1)
    b = model(tokens)
    assert not torch.equal(a, b)
    torch.manual_seed(0)
    assert torch.equal(model(tokens), a)  # the global generator decides the masks
    model.eval()
    assert torch.equal(model(tokens), model(tokens))
    assert model.layers[0].attention.dropout.p == 0.5
    assert model.layers[0].mlp.dropout.p == 0.5
    assert GPT(SMALL).layers[0].mlp.dropout.p == 0.0


def test_block_runner_sees_every_block_by_name() -> None:
    model = GPT(SMALL)
    tokens, _ = make_batch(SMALL, 2, seed=0)
    seen = []

    def runner(block: nn.Module, x: torch.Tensor, name: str) -> torch.Tensor:
        seen.append((name, block is model.get_submodule(name)))
        return block(x)

    plain = model(tokens)
    model.block_runner = runner
    assert torch.equal(model(tokens), plain)
    assert seen == [("layers.0", True), ("layers.1", True)]


def test_make_batch() -> None:
    tokens, targets = make_batch(SMALL, 5, seed=3)
    assert tokens.dtype == targets.dtype == torch.int64
    assert tokens.shape == targets.shape == (5, SMALL.seq_len)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    assert int(tokens.min()) >= 0 and int(tokens.max()) < SMALL.vocab_size
    again, _ = make_batch(SMALL, 5, seed=3)
    assert torch.equal(tokens, again)
    other, _ = make_batch(SMALL, 5, seed=4)
    assert not torch.equal(tokens, other)
    state = torch.get_rng_state()
    make_batch(SMALL, 5, seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(ValueError):
        make_batch(SMALL, 0, seed=0)


def test_loss_falls_in_a_few_steps() -> None:
    model = GPT(SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(12):
        tokens, targets = make_batch(SMALL, 8, seed=step)
        loss = model.loss(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize(
    "field, value",
    [("dim", 30), ("n_heads", 0), ("dropout", 1.0), ("vocab_size", -1)],
)
def test_config_validation(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        GPTConfig(**{**vars(SMALL), field: value})
