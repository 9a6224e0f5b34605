"""Remat plans for the reference GPT, shared by the report tests.

Each plan is a ``GPT.block_runner``: how one block runs (checkpointed or not, and
which of its calls are save regions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import remat_dist as remat
from remat_dist.models import GPT, GPTConfig, make_batch

CONFIG = GPTConfig(vocab_size=32, seq_len=8, dim=16, n_heads=2, n_layers=4)

PLANS = ("none", "full", "attention_saved", "attention_saved_residual_region")


def _body(block: Any, x: torch.Tensor, plan: str, probe: Callable[[], None] | None):
    if plan == "full":
        x = x + block.attention(block.ln1(x))
        if probe is not None:
            probe()
        return x + block.mlp(block.ln2(x))
    attn = remat.region(block.attention, "attention", recompute=False)(block.ln1(x))
    if probe is not None:
        probe()
    if plan == "attention_saved":
        # bare code consumes the save region's output: persist it explicitly
        remat.recompute_needs_tensor(attn)
        x = x + attn
    else:
        # a recompute region consumes it: the core persists it by itself
        x = remat.region(torch.add, "residual", recompute=True)(x, attn)
    return x + block.mlp(block.ln2(x))


def runner(plan: str, probe: Callable[[], None] | None = None) -> Any:
    """The ``block_runner`` of ``plan``; ``probe`` is called inside each block's
    forward (after its first region), e.g. to take a current-memory report."""
    if plan == "none":
        return None

    def run(block: Any, x: torch.Tensor, name: str) -> torch.Tensor:
        return remat.checkpoint(region_name=name)(_body)(block, x, plan, probe)

    return run


def model_and_batch(
    plan: str,
    *,
    batch_size: int = 2,
    seed: int = 1,
    config: GPTConfig = CONFIG,
    probe: Callable[[], None] | None = None,
) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    model = GPT(config)
    model.block_runner = runner(plan, probe)
    tokens, targets = make_batch(config, batch_size, seed=seed)
    return model, tokens, targets
