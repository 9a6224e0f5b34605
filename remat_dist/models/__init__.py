"""Reference models used by tests, benchmarks and the launchers."""

from remat_dist.models._gpt import (
    GPT,
    MLP,
    Attention,
    Block,
    GPTConfig,
    GPTStage,
    block_tp_plan,
    make_batch,
)

__all__ = [
    "GPT",
    "MLP",
    "Attention",
    "Block",
    "GPTConfig",
    "GPTStage",
    "block_tp_plan",
    "make_batch",
]
