"""A replay that does not do what its forward did raises ``ReplayMismatchError``
naming the checkpoint, the region, the first saved tensor that differs, both
metadata and the fixes, instead of crashing later inside model code or computing
gradients from it. By default the replay's saves are compared when it ends (also
when it raised inside model code because of them); with
``determinism_check="metadata_per_tensor"`` each is compared as it is saved, and the error also
names the model line that saved it.

The block under test keeps a Python-list cache that every call appends to, as a
KV cache with ``use_cache=True`` does: its replay in backward sees a longer cache.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn

import remat_dist as remat


class CachedAttention(nn.Module):
    """Attention over the keys of every call so far (a list-backed KV cache)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.cache: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.proj(x)
        self.cache.append(k)
        keys = torch.cat(self.cache, dim=1)
        weights = (x @ keys.transpose(1, 2)).softmax(-1)
        return weights @ keys


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.attention = CachedAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + remat.region(self.attention, "attention", recompute=True)(self.norm(x))


def _x() -> torch.Tensor:
    return torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()


_LONGER_CACHE = (
    "in region 'layers.0::attention' has another shape than on forward",
    "forward: shape (2, 8, 4), dtype torch.float32, device cpu",
    "replay:  shape (2, 8, 8), dtype torch.float32, device cpu",
)
"""What the error says of the block's replay over a cache one call longer: the
region and both shapes."""

_SAVED_AT = (
    "test_replay_mismatch.py",
    "weights = (x @ keys.transpose(1, 2)).softmax(-1)",
    "device cpu, made by",
)
"""What ``determinism_check="metadata_per_tensor"`` adds: the model line and the op that saved
it."""


def _assert_says(msg: str, *fragments: str) -> None:
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


def _replay_error(block: nn.Module, **options) -> remat.errors.ReplayMismatchError:
    """The error backward raises through ``block`` checkpointed as 'layers.0'."""
    out = remat.checkpoint(region_name="layers.0", **options)(block)(_x())
    with pytest.raises(remat.errors.ReplayMismatchError) as info:
        out.sum().backward()
    return info.value


def test_a_cache_appended_to_on_replay_raises_a_clear_error():
    torch.manual_seed(0)
    block = Block()
    error = _replay_error(block)
    msg = str(error)
    _assert_says(
        msg,
        "the replay of checkpoint 'layers.0' did not reproduce its forward",
        *_LONGER_CACHE,
        "use_cache=False",
        "recompute_state_hooks",
        "remat_dist.is_recomputing()",
        "determinism_check='metadata_per_tensor'",  # how to get the model line
    )
    assert "saved at" not in msg
    assert isinstance(error, tuc.CheckpointError)  # what torch raises here
    assert all(p.grad is None for p in block.parameters())  # no gradient from it


@pytest.mark.parametrize("check", ["metadata_per_tensor", "default"])
def test_determinism_check_per_tensor_names_the_model_line_that_saved_it(check):
    """torch's name "default" is an alias of "metadata_per_tensor"."""
    torch.manual_seed(0)
    block = Block()
    error = _replay_error(block, determinism_check=check)
    _assert_says(str(error), *_LONGER_CACHE, *_SAVED_AT)
    assert block.attention.proj.weight.grad is None


@pytest.mark.parametrize("check", ["metadata", "none"])
def test_determinism_check_metadata_checks_at_the_replay_end(check):
    """The default, ``"metadata"`` (torch's name ``"none"`` is its alias), checks
    the replay's saves when it ends: no model line."""
    torch.manual_seed(0)
    error = _replay_error(Block(), determinism_check=check)
    _assert_says(str(error), *_LONGER_CACHE)
    assert "saved at" not in str(error)


@pytest.mark.parametrize("check", ["metadata", "metadata_per_tensor"])
def test_a_call_site_whose_earlier_replays_matched_still_raises_at_the_first_difference(
    check,
):
    """The second call of a call site notes its saves' metadata in short form (its
    first forward saved only plain tensors); its replay is checked as strictly."""
    torch.manual_seed(0)
    block = Block()
    run = remat.checkpoint(region_name="layers.0", determinism_check=check)(block)
    out = run(_x())
    block.attention.cache.clear()  # the first replay sees what its forward saw
    out.sum().backward()
    block.attention.cache.clear()
    out = run(_x())
    with pytest.raises(remat.errors.ReplayMismatchError) as info:
        out.sum().backward()
    line = _SAVED_AT if check == "metadata_per_tensor" else ()
    _assert_says(str(info.value), *_LONGER_CACHE, *line)


class ReshapingAttention(CachedAttention):
    """Fails inside its replay because of the longer cache, after saving a tensor
    of the longer shape (as model code with a KV cache does, deep inside)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.proj(x)
        self.cache.append(k)
        keys = torch.cat(self.cache, dim=1)
        weights = (x @ keys.transpose(1, 2)).softmax(-1)
        return weights.reshape(2, 4, 4) @ k


def test_a_replay_that_fails_in_model_code_because_of_a_mismatch_raises_the_mismatch():
    error = _replay_error(ReshapingAttention())
    _assert_says(
        str(error),
        "saved tensor #",
        "has another shape than on forward",
        "found when the replay raised RuntimeError",
        "return weights.reshape(2, 4, 4) @ k",  # where the model failed
        "use_cache=False",
    )
    assert isinstance(error.__cause__, RuntimeError)  # the model's own error


def test_a_replay_for_a_second_backward_skips_what_the_first_freed():
    """Two backward passes over the two outputs of one checkpoint: the second
    replays it for a graph task whose first output's saved tensors are gone (torch
    recomputes but does not keep them); what it keeps is checked, the gradients
    are those without the checkpoint."""
    a = torch.randn(4, 4, requires_grad=True)
    b = torch.randn(4, 4, requires_grad=True)

    def f(a, b):
        return a.sin() * a, (b @ b).exp()

    outs = remat.checkpoint(region_name="two")(f)(a, b)
    outs[0].sum().backward()
    outs[1].sum().backward()
    grads = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    ref = f(a, b)
    ref[0].sum().backward()
    ref[1].sum().backward()
    assert torch.equal(grads[0], a.grad) and torch.equal(grads[1], b.grad)


class CacheLength:
    """A RecomputeStateHook that puts the cache back to its length at entry."""

    def __init__(self, cache: list[torch.Tensor]) -> None:
        self.cache = cache

    def snapshot(self) -> int:
        return len(self.cache)

    def restore(self, state: int) -> None:
        del self.cache[state:]


def test_the_fix_named_in_the_error_gives_the_gradients_of_no_checkpoint():
    torch.manual_seed(0)
    block = Block()
    x = _x()
    block(x).sum().backward()
    ref = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    block.attention.cache.clear()
    hooks = (*remat.distributed.default_state_hooks(), CacheLength(block.attention.cache))
    remat.checkpoint(region_name="layers.0", recompute_state_hooks=hooks)(block)(x).sum().backward()
    for p, r in zip(block.parameters(), ref):
        assert torch.equal(p.grad, r)


def test_a_flag_that_skips_work_on_replay_is_a_short_replay():
    lin = nn.Linear(8, 8)
    calls = []

    def f(x):
        calls.append(1)
        y = lin(x).tanh()
        if len(calls) == 1:  # a Python flag: forward only
            y = (y * y).sigmoid()
        return y

    out = remat.checkpoint(region_name="flagged")(f)(_x())
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        with pytest.raises(remat.errors.ReplayMismatchError) as info:
            out.sum().backward()
    msg = str(info.value)
    assert "the replay of checkpoint 'flagged' did not reproduce its forward" in msg
    m = re.search(r"having saved (\d+) tensor\(s\) for backward where the forward saved (\d+)", msg)
    assert m is not None and int(m[1]) < int(m[2]), msg
    assert f"the first one missing is saved tensor #{m[1]}" in msg


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="notes: Python 3.11+")
def test_another_error_raised_in_a_replay_keeps_its_type_and_gets_a_note():
    lin = nn.Linear(8, 8)
    calls = []

    def f(x):
        calls.append(1)
        if len(calls) > 1:
            raise ValueError("state gone")
        return lin(x).tanh()

    out = remat.checkpoint(region_name="fragile")(f)(_x())
    with pytest.raises(ValueError, match="state gone") as info:
        out.sum().backward()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised while replaying checkpoint 'fragile' in backward" in notes
    assert "use_cache=False" in notes


def test_a_replay_whose_frame_cannot_be_read_is_checked_per_tensor(monkeypatch):
    """Where torch's recompute hook is not the innermost one at a replay's start (a
    torch whose checkpoint changed), the replay is still checked: per saved tensor,
    as with determinism_check="metadata_per_tensor", never not at all."""
    from remat_dist.core import _standin

    monkeypatch.setattr(_standin, "replay_target_here", lambda: None)
    torch.manual_seed(0)
    _assert_says(str(_replay_error(Block())), *_LONGER_CACHE, *_SAVED_AT)
