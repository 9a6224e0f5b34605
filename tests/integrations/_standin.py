"""A small model and AC configs shaped like torchtitan's, for the adapter tests.

The model has what the adapter relies on: ``model.layers`` (a ModuleDict of
``TransformerBlock``), each block with ``attention`` and either ``feed_forward`` or
``moe`` (``moe_enabled``), and an MoE that counts the tokens routed to each expert
into the buffer ``tokens_per_expert_E`` on every training forward. The configs
mirror the two shapes torchtitan has used: the job config with ``mode`` /
``selective_ac_option``, and per-policy ``FullAC.Config`` / ``SelectiveAC.Config``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, EXPERTS, TOP_K, VOCAB = 16, 2, 4, 2, 32


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.wqkv(x).view(b, s, 3, HEADS, DIM // HEADS).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=0.1 if self.training else 0.0
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, DIM))


class FeedForward(nn.Module):
    def __init__(self, hidden: int = 2 * DIM) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, hidden, bias=False)
        self.w2 = nn.Linear(hidden, DIM, bias=False)
        self.w3 = nn.Linear(DIM, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Top-k token-choice routing over small experts; counts tokens per expert."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(FeedForward(DIM) for _ in range(EXPERTS))
        self.load_balance_coeff = 1e-3
        self.register_buffer("expert_bias_E", torch.zeros(EXPERTS))
        self.register_buffer("tokens_per_expert_E", torch.zeros(EXPERTS), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, DIM)
        scores = torch.sigmoid(self.gate(flat))
        _, chosen = torch.topk(scores + self.expert_bias_E, TOP_K, dim=-1)
        weights = scores.gather(-1, chosen)
        routed = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert_E.add_(routed.sum(0))
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return out.view_as(x)


class TransformerBlock(nn.Module):
    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.moe_enabled = moe
        if moe:
            self.moe = MoE()
        else:
            self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        mlp = self.moe if self.moe_enabled else self.feed_forward
        return h + mlp(self.ffn_norm(h))


class Model(nn.Module):
    """Four blocks; blocks 1 and 3 are MoE blocks."""

    def __init__(self, n_layers: int = 4) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(moe=i % 2 == 1) for i in range(n_layers)}
        )
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h))


def build(seed: int = 0) -> Model:
    torch.manual_seed(seed)
    return Model()


def train_step(model: Model, seed: int = 1, steps: int = 1) -> dict[str, torch.Tensor]:
    """``steps`` forward/backward passes (gradients accumulate); returns the
    loss, every gradient and every MoE token counter."""
    torch.manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 8))
    loss = torch.zeros(())
    for _ in range(steps):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
    out = {"loss": loss.detach()}
    out.update({f"grad:{n}": p.grad.clone() for n, p in model.named_parameters()})
    out.update(
        {f"count:{n}": m.tokens_per_expert_E.clone()
         for n, m in model.named_modules() if isinstance(m, MoE)}
    )
    return out


@dataclass
class JobACConfig:
    """The older torchtitan job config section (``--activation_checkpoint.*``)."""

    mode: str = "selective"
    selective_ac_option: str = "2"
    preserve_rng_state: bool = True
    determinism_check: str = "default"
    early_stop: bool = True
    debug: bool = False


class FullAC:
    """Stand-in for the newer policy classes: only the ``Config`` qualname matters."""

    @dataclass
    class Config:
        preserve_rng_state: bool = True
        determinism_check: str = "default"
        debug: bool = False


class SelectiveAC:
    @dataclass
    class Config:
        preserve_rng_state: bool = True
        determinism_check: str = "default"
        debug: bool = False


class MemoryBudgetAC:
    @dataclass
    class Config:
        memory_budget: float = 0.5
