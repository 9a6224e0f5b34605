"""A replay that does not do what its forward did raises ``ReplayMismatchError`` at
the first saved tensor that differs, naming the checkpoint, the region, the tensor,
both metadata and the fixes, instead of crashing later inside model code.

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
    "weights = (x @ keys.transpose(1, 2)).softmax(-1)",
    "forward: shape (2, 8, 4), dtype torch.float32, device cpu",
    "replay:  shape (2, 8, 8), dtype torch.float32, device cpu, made by",
)
"""What the error says of the block's replay over a cache one call longer: the
region, the line that saved the tensor, both shapes."""


def _assert_says(msg: str, *fragments: str) -> None:
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


def test_a_cache_appended_to_on_replay_raises_a_clear_error():
    torch.manual_seed(0)
    block = Block()
    out = remat.checkpoint(region_name="layers.0")(block)(_x())
    with pytest.raises(remat.ReplayMismatchError) as info:
        out.sum().backward()
    _assert_says(
        str(info.value),
        "the replay of checkpoint 'layers.0' did not reproduce its forward",
        "test_replay_mismatch.py",  # the line of model code that saved it
        *_LONGER_CACHE,
        "use_cache=False",
        "recompute_state_hooks",
        "remat_dist.is_recomputing()",
    )
    assert isinstance(info.value, tuc.CheckpointError)  # what torch raises here


def test_a_call_site_whose_earlier_replays_matched_still_raises_at_the_first_difference():
    """The second call of a call site notes its saves' metadata in short form (its
    first forward saved only plain tensors); its replay is checked as strictly."""
    torch.manual_seed(0)
    block = Block()
    run = remat.checkpoint(region_name="layers.0")(block)
    out = run(_x())
    block.attention.cache.clear()  # the first replay sees what its forward saw
    out.sum().backward()
    block.attention.cache.clear()
    out = run(_x())
    with pytest.raises(remat.ReplayMismatchError) as info:
        out.sum().backward()
    _assert_says(str(info.value), *_LONGER_CACHE)


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
    hooks = (*remat.default_state_hooks(), CacheLength(block.attention.cache))
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
        with pytest.raises(remat.ReplayMismatchError) as info:
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
