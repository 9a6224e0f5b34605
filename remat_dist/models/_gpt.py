"""A small GPT-style language model: the reference model of tests, benchmarks and
the launcher.

Layout (qualified names are stable, tensor-parallel plans rely on them)::

    tok_emb, pos_emb                      Embedding
    layers.{i}                            Block (nn.ModuleList "layers")
        ln1 -> attention -> + residual        attention.{wq, wk, wv, wo}: Linear
        ln2 -> mlp       -> + residual        mlp.{w1, w2}: Linear, GELU between
    norm                                  final LayerNorm
    lm_head                               Linear(dim, vocab_size, bias=False)

``attention.wq/wk/wv`` and ``mlp.w1`` can be split column-wise and
``attention.wo`` / ``mlp.w2`` row-wise (see :func:`block_tp_plan`): attention reads
its head count from the local width of ``q``, so it runs unchanged on a shard of
the heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "GPTConfig",
    "Attention",
    "MLP",
    "Block",
    "make_batch",
    "block_tp_plan",
]


@dataclass(frozen=True)
class GPTConfig:
    """Shape and initialisation of a :class:`GPT`.

    Attributes:
        vocab_size: number of token ids; tokens are in ``[0, vocab_size)``.
        seq_len: the longest sequence the model accepts (size of the learned
            position embedding); :func:`make_batch` makes sequences this long.
        dim: model width (embedding and residual stream size).
        n_heads: attention heads; must divide ``dim`` (head size is
            ``dim // n_heads``) and, under tensor parallelism, be divisible by the
            TP degree.
        n_layers: number of transformer blocks (``model.layers``).
        mlp_ratio: MLP hidden width is ``int(dim * mlp_ratio)``.
        dropout: dropout probability after the attention output projection and
            after the MLP output projection (0.0 disables it).
        seed: seed of the parameter initialisation: the same config always gives the
            same weights, whatever the global RNG state (which it leaves untouched).
        bias: whether the attention and MLP Linear layers have biases.
    """

    vocab_size: int = 256
    seq_len: int = 32
    dim: int = 64
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    seed: int = 0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "dim", "n_heads", "n_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int: {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"GPTConfig.n_heads ({self.n_heads}) must divide dim ({self.dim})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1): {self.dropout!r}")
        if self.mlp_ratio <= 0 or int(self.dim * self.mlp_ratio) < 1:
            raise ValueError(f"GPTConfig.mlp_ratio too small: {self.mlp_ratio!r}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """MLP hidden width."""
        return int(self.dim * self.mlp_ratio)


class Attention(nn.Module):
    """Causal multi-head self-attention (``scaled_dot_product_attention``)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=config.bias)
        self.wk = nn.Linear(config.dim, config.dim, bias=config.bias)
        self.wv = nn.Linear(config.dim, config.dim, bias=config.bias)
        self.wo = nn.Linear(config.dim, config.dim, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # Local head count: a tensor-parallel shard holds only some of the heads.
        n_heads = q.shape[-1] // self.head_dim

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, n_heads, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, n_heads * self.head_dim)
        return self.dropout(self.wo(y))


class MLP(nn.Module):
    """Linear -> GELU -> Linear -> dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=config.bias)
        self.act = nn.GELU()
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(self.act(self.w1(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attention(ln1(x))``, then
    ``x + mlp(ln2(x))``. ``forward(x)`` takes and returns ``(batch, seq, dim)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.dim)
        self.attention = Attention(config)
        self.ln2 = nn.LayerNorm(config.dim)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embedding, ``n_layers`` blocks, final norm, LM head.

    ``model(tokens)`` maps ``(batch, seq)`` int64 token ids to ``(batch, seq,
    vocab_size)`` logits; :meth:`loss` adds the cross-entropy against targets.

    Args:
        config: the shape; its ``seed`` fixes the initial weights.
        device: where to build the parameters (default CPU). Weights are drawn on
            the CPU from a private generator, so they are the same on every device.
    """

    block_runner: Any
    """Optional ``(block, x, name) -> y`` called instead of ``block(x)`` for each
    block (``name`` is ``"layers.{i}"``); how a launcher checkpoints blocks without
    changing module types or state-dict keys. None: call each block directly."""

    def __init__(self, config: GPTConfig, *, device: torch.device | str | None = None):
        super().__init__()
        self.config = config
        self.block_runner = None
        # The layers' own initialisers draw from the global CPU generator; its
        # state is put back, and init_weights() sets the real values. (Building on
        # "meta" instead would import torch._dynamo: a second on first use.)
        rng_state = torch.get_rng_state()
        try:
            self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
            self.pos_emb = nn.Embedding(config.seq_len, config.dim)
            self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
            self.norm = nn.LayerNorm(config.dim)
            self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        finally:
            torch.set_rng_state(rng_state)
        self.init_weights()
        if device is not None:
            self.to(device)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter from ``seed`` (default ``config.seed``).

        GPT-2 style: Linear and Embedding weights ~ N(0, 0.02), the residual output
        projections (``wo``, ``w2``) scaled by ``1/sqrt(2 * n_layers)``, biases 0,
        LayerNorm weight 1 and bias 0. Draws in ``named_parameters()`` order from a
        private CPU generator; the global RNG is not touched.
        """
        gen = torch.Generator(device="cpu")
        gen.manual_seed(self.config.seed if seed is None else seed)
        std = 0.02
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            module_name = name.rsplit(".", 2)[-2] if "." in name else ""
            if leaf == "bias":
                value = torch.zeros(param.shape)
            elif module_name in ("ln1", "ln2", "norm"):
                value = torch.ones(param.shape)
            else:
                scale = residual_std if module_name in ("wo", "w2") else std
                value = torch.randn(param.shape, generator=gen) * scale
            param.copy_(value.to(param.dtype))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq), got {tuple(tokens.shape)}")
        seq = tokens.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds GPTConfig.seq_len {self.config.seq_len}"
            )
        positions = torch.arange(seq, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        runner = self.block_runner
        for i, block in enumerate(self.layers):
            x = block(x) if runner is None else runner(block, x, f"layers.{i}")
        return self.lm_head(self.norm(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``self(tokens)`` against ``targets``."""
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def make_batch(
    config: GPTConfig, batch_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic batch: ``(tokens, targets)``, both int64 of shape
    ``(batch_size, config.seq_len)``, targets being tokens shifted by one.

    Each row counts up from a random start with a random stride of 1 or 2 (modulo
    ``vocab_size``): the next token is predictable from the context, so the loss
    falls within a few steps. Deterministic in ``seed``; independent of (and not
    advancing) the global RNG. Give each rank and step its own seed.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive: {batch_size!r}")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    start = torch.randint(0, config.vocab_size, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 3, (batch_size, 1), generator=gen)
    steps = torch.arange(config.seq_len + 1, dtype=torch.int64)
    seq = (start + stride * steps) % config.vocab_size
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def block_tp_plan() -> dict[str, Any]:
    """Tensor-parallel plan for one :class:`Block`, for
    ``parallelize_module(block, tp_mesh, block_tp_plan())``: column-wise
    ``attention.wq/wk/wv`` and ``mlp.w1``, row-wise ``attention.wo`` and
    ``mlp.w2`` (``remat_dist.shard.reference_tp_plan().block``, which ``shard_model``
    applies). Needs ``n_heads`` divisible by the TP degree."""
    from remat_dist.shard import reference_tp_plan

    return dict(reference_tp_plan().block)


class GPTStage(nn.Module):
    """The blocks ``layer_ids`` of a :class:`GPT` that one pipeline stage runs, for
    ``torch.distributed.pipelining.PipelineStage``: the first stage also embeds,
    the last ends with the final norm and the head. The blocks keep their
    qualified names (``layers.{i}``), so a checkpoint's region name is the full
    model's on every stage."""

    def __init__(self, model: GPT, layer_ids: list[int], *, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        if last:
            self.norm, self.lm_head = model.norm, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.layers.values():
            x = block(x)
        if self.last:
            x = self.lm_head(self.norm(x))
        return x
