"""Compiled blocks are guarded on their save regions: a block compiled under one
policy is not reused for a block of the same code under another (two models in
one process, or one model re-planned), which would keep the wrong activations
without a word."""

from __future__ import annotations

import torch

import remat_dist as remat
from remat_dist.models import GPT, Block, GPTConfig, make_batch
from remat_dist.testing import PeakSavedBytes

CONFIG = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=2)


def _forward_bytes(policy) -> int:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    remat.apply_remat(model, blocks=Block, policy=policy)
    for block in model.layers:
        block.compile(backend="aot_eager", fullgraph=True)
    tokens, targets = make_batch(CONFIG, 2, seed=0)
    meter = PeakSavedBytes(model, whole_step=True)
    with meter:
        model.loss(tokens, targets).backward()
    return meter.forward_peak


def test_a_policy_with_save_regions_is_not_served_the_graph_of_full_recompute():
    save = {"attention": "save"}
    torch._dynamo.reset()
    alone = _forward_bytes(save)
    torch._dynamo.reset()
    full = _forward_bytes("full")
    after_full = _forward_bytes(save)
    torch._dynamo.reset()
    assert alone > full  # the save region keeps the attention's activations
    assert after_full == alone
