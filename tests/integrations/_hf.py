"""Small transformers models from configs (random init, nothing downloaded), one per
architecture family, and a training step that records what the tests compare.

Imported only by the transformers tests, which skip when transformers is missing.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from remat_dist.testing import SavedBytesCounter

FAMILIES = ("llama", "qwen2", "mixtral", "gemma2", "gpt2")
"""Dense (Llama with as many kv heads as heads), grouped-query (Qwen2), mixture of
experts (Mixtral), sliding-window (Gemma2) and GPT-2 style (GPT2)."""

VOCAB = 64
SEQ = 16

_COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=VOCAB,
)


def build(family: str, attn: str = "eager", seed: int = 0, **extra: Any) -> nn.Module:
    """A 2-layer model of ``family`` with seeded random weights, in training mode."""
    import transformers as tf

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family == "llama":
            # head_dim 16 (see gpt2 below)
            cfg = tf.LlamaConfig(
                **{**_COMMON, "hidden_size": 64}, num_key_value_heads=4,
                attn_implementation=attn,
            )
            model = tf.LlamaForCausalLM(cfg)
        elif family == "qwen2":
            cfg = tf.Qwen2Config(**_COMMON, num_key_value_heads=2, attn_implementation=attn)
            model = tf.Qwen2ForCausalLM(cfg)
        elif family == "mixtral":
            cfg = tf.MixtralConfig(
                **_COMMON, num_key_value_heads=2, num_local_experts=4,
                num_experts_per_tok=2, attn_implementation=attn, **extra,
            )
            model = tf.MixtralForCausalLM(cfg)
        elif family == "gemma2":
            cfg = tf.Gemma2Config(
                **_COMMON, num_key_value_heads=2, head_dim=8, sliding_window=4,
                attn_implementation=attn,
            )
            model = tf.Gemma2ForCausalLM(cfg)
        elif family == "gpt2":
            # head_dim 16: with multi-head attention of head_dim 8 the gradients of
            # a replayed layer differ from no checkpointing in the last bits on
            # this CPU build of torch, with transformers' own checkpointing too
            cfg = tf.GPT2Config(
                n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                bos_token_id=0, eos_token_id=0, attn_implementation=attn,
            )
            model = tf.GPT2LMHeadModel(cfg)
        else:
            raise ValueError(family)
    return model.train()


def batch(size: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(seed))


def step(model: nn.Module, ids: torch.Tensor, seed: int, **kwargs: Any) -> tuple[int, dict, Any]:
    """One forward and backward (``torch.manual_seed(seed)`` first, so dropout draws
    alike): saved activation bytes, the gradients (local shards under FSDP2) and
    the output. Gradients are cleared first."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    with SavedBytesCounter(model.parameters()) as count:
        out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = None if g is None else (g.to_local() if hasattr(g, "to_local") else g).clone()
    return count.activation_bytes, grads, out


def same(a: dict, b: dict) -> list[str]:
    """Names of the gradients that are not bitwise equal (empty: all are)."""
    assert a.keys() == b.keys()
    return [n for n in a if (a[n] is None) != (b[n] is None) or (
        a[n] is not None and not torch.equal(a[n], b[n]))]
