"""Reports and errors call a checkpoint's inputs by the parameter they bind to.

A block ``forward(self, hidden_states, attention_mask=None)`` shows
``hidden_states`` and ``attention_mask``, not ``input 0`` and ``input 1``; an entry
of ``*args`` shows as ``args[0]``; ``input {i}`` is left only where the function
has no signature. The names cost a call nothing: the signature is read when a
report asks, once per function.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch import nn

import remat_dist as remat
from remat_dist.report import build_saved_tensors_report, format_saved_tensors_report


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden_states, attention_mask=None):
        out = self.proj(hidden_states).sin()
        return out if attention_mask is None else out * attention_mask


class Model(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x, mask=None, *, by_keyword=True):
        for layer in self.layers:
            x = layer(x, attention_mask=mask) if by_keyword else layer(x, mask)
        return x


def _input_labels(roots) -> dict[str, list[str]]:
    report = build_saved_tensors_report(roots)
    return {cp.name: [r.label for r in cp.inputs] for cp in report.checkpoints}


@pytest.mark.parametrize("by_keyword", [True, False])
def test_apply_remat_block_inputs_are_named_by_forwards_parameters(by_keyword):
    # a save region makes the report print each checkpoint's detail
    model = remat.apply_remat(Model(), blocks=Block, policy={"proj": "save"})
    x = torch.randn(2, 8, requires_grad=True)
    mask = torch.rand(2, 8)
    loss = model(x, mask, by_keyword=by_keyword).sum()
    labels = _input_labels(loss)
    assert labels["layers.0"] == ["hidden_states", "attention_mask"]
    # layers.1's mask is layers.0's: counted once, where it first appears
    assert labels["layers.1"][0] == "hidden_states"
    text = format_saved_tensors_report(loss)
    assert re.search(r"64 B  hidden_states +\(2, 8\)", text), text
    assert re.search(r"64 B  attention_mask +\(2, 8\)", text), text
    assert "input 0" not in text
    loss.backward()


def test_an_instance_forward_set_before_apply_remat_names_the_inputs():
    block = Block()

    def forward(tokens, mask=None):  # a wrapper's forward, set on the instance
        return Block.forward(block, tokens, mask)

    block.forward = forward
    model = remat.apply_remat(nn.Sequential(block), blocks=Block)
    x = torch.randn(2, 8, requires_grad=True)
    assert _input_labels(model(x).sum()) == {"0": ["tokens"]}


def test_function_checkpoint_names_positionals_varargs_and_keywords():
    def body(first, *rest, scale):
        return (first.sin() * rest[0] * rest[1]).cos() * scale

    a, b, c, s = (torch.randn(4, requires_grad=True) for _ in range(4))
    out = remat.checkpoint(region_name="f")(body)(a, b * 2, c * 3, scale=s)
    assert _input_labels(out) == {"f": ["first", "rest[0]", "rest[1]", "scale"]}


def test_a_function_without_signature_keeps_input_index():
    x = torch.randn(4, requires_grad=True)
    out = remat.checkpoint(region_name="f")(torch.sin)(x * 2)
    assert _input_labels(out) == {"f": ["input 0"]}


def test_inputs_under_user_saved_tensor_hooks_are_named_too():
    hooks = remat.saved_tensors_hooks(lambda t: t, lambda t: t)
    model = remat.apply_remat(Model(blocks=1), blocks=Block)
    x = torch.randn(2, 8, requires_grad=True)
    with hooks:
        loss = model(x, torch.rand(2, 8)).sum()
    assert _input_labels(loss)["layers.0"] == ["hidden_states", "attention_mask"]


def test_torch_utils_checkpoint_inputs_are_named():
    block = Block()
    x = torch.randn(2, 8, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(block, x * 2, use_reentrant=False)
    text = format_saved_tensors_report(out)
    assert re.search(r"64 B  hidden_states +\(2, 8\)", text), text


class _CountedSignature:
    """A checkpointed callable that counts how often its signature is read."""

    reads = 0

    @property
    def __signature__(self):
        type(self).reads += 1
        return inspect.signature(lambda query, key: None)

    def __call__(self, query, key):
        return query.sin() * key


def test_a_call_reads_no_signature_and_reports_read_it_once():
    fn = _CountedSignature()
    run = remat.checkpoint(region_name="attn")(fn)
    q, k = torch.randn(4, requires_grad=True), torch.randn(4)
    outs = [run(q * 2, k) for _ in range(3)]
    assert _CountedSignature.reads == 0
    assert _input_labels(outs[0]) == {"attn": ["query", "key"]}
    again = _input_labels(outs[1:])
    assert list(again.values()) == [["query", "key"]] * 2
    assert _CountedSignature.reads == 1


def test_a_region_layout_error_names_the_regions_parameter():
    def act(hidden):
        return hidden.sin()

    def body(x):
        h = x * 2
        if remat.is_recomputing():  # same values, transposed strides
            h = h.t().contiguous().t()
        return remat.region(act, "act", recompute=False)(h).sum()

    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(remat.RematError, match=r"\(hidden: expected shape"):
        remat.checkpoint(region_name="blk")(body)(x).backward()
