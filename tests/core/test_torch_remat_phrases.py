"""Each misuse torch_remat 0.2.x refuses is refused here with torch_remat's key
phrase in the message (code and tests that match on its messages keep working),
followed by remat_dist's own text: the region, and the fix.

The phrases are those of torch_remat 0.2.2's messages for the same misuse.
"""

from __future__ import annotations

import pytest
import torch

import remat_dist as remat

PHRASES = {
    "fresh_leaf": "returned a leaf tensor that requires grad",
    "preserve_rng_state": "does not preserve torch's RNG state",
    "not_callable": "region expects a function as its first argument",
    "duplicate_name": "Duplicate torch_remat region name",
    "recompute_false_then_true": "Conflicting recompute settings for",
    "recompute_true_then_false": "No save record for",
    "recompute_in_save": (
        "was called with recompute=True while nested inside a recompute=False "
        "(SAVE) region"
    ),
    "view_layout": (
        "saved a view of an input for backward, but recompute reproduced that "
        "input with a different layout"
    ),
}
"""misuse -> torch_remat's key phrase."""


def _x() -> torch.Tensor:
    return torch.randn(
        4, 4, generator=torch.Generator().manual_seed(0)
    ).requires_grad_()


def _fresh_leaf():
    def body(x):
        bias = remat.region(
            lambda t: torch.zeros(4, requires_grad=True), "bias", recompute=True
        )(x)
        return (x + bias).sum()

    remat.checkpoint(region_name="blk")(body)(_x())


def _preserve_rng_state():
    remat.checkpoint(region_name="blk", preserve_rng_state=True)


def _not_callable():
    remat.region(3, "act", recompute=False)


def _duplicate_name():
    def body(x):
        h = remat.region(torch.sin, "act", recompute=True)(x)
        return remat.region(torch.sin, "act", recompute=True)(h).sum()

    remat.checkpoint(region_name="blk")(body)(_x())


def _flag_changes(first: bool):
    def body(x):
        flag = first != remat.is_recomputing()
        h = remat.region(torch.sin, "act", recompute=flag)(x)
        return (h * x).cos().sum()

    remat.checkpoint(region_name="blk")(body)(_x()).backward()


def _recompute_in_save():
    def outer(t):
        return remat.region(torch.cos, "inner", recompute=True)(t.sin())

    def body(x):
        return remat.region(outer, "outer", recompute=False)(x).sum()

    remat.checkpoint(region_name="blk")(body)(_x())


def _view_layout():
    def body(x):
        h = x * 2
        if remat.is_recomputing():  # same values, transposed strides
            h = h.t().contiguous().t()
        return remat.region(torch.sin, "act", recompute=False)(h).sum()

    remat.checkpoint(region_name="blk")(body)(_x()).backward()


MISUSES = {
    "fresh_leaf": (_fresh_leaf, "'blk::bias'"),
    "preserve_rng_state": (_preserve_rng_state, "region_name='blk'"),
    "not_callable": (_not_callable, "'act'"),
    "duplicate_name": (_duplicate_name, "'blk::act'"),
    "recompute_false_then_true": (lambda: _flag_changes(False), "'blk::act'"),
    "recompute_true_then_false": (lambda: _flag_changes(True), "'blk::act'"),
    "recompute_in_save": (_recompute_in_save, "'blk::inner'"),
    "view_layout": (_view_layout, "'blk::act'"),
}
"""misuse -> (code that commits it, how the message names the region)."""


@pytest.mark.parametrize("misuse", sorted(PHRASES))
def test_message_has_torch_remat_phrase_then_region_and_fix(misuse):
    run, region = MISUSES[misuse]
    with pytest.raises(remat.RematError) as info:
        run()
    msg = str(info.value)
    assert PHRASES[misuse] in msg, msg
    assert region in msg, msg
    assert "Fix:" in msg.split(PHRASES[misuse], 1)[1], msg


def test_every_misuse_has_a_phrase_and_a_case():
    assert PHRASES.keys() == MISUSES.keys()


@pytest.mark.parametrize("graph_break", [False, True])
def test_compiled_recompute_in_save_has_the_phrase(graph_break):
    def outer(t):
        if graph_break:
            torch._dynamo.graph_break()
        return remat.region(torch.cos, "inner", recompute=True)(t.sin())

    def body(x):
        return remat.region(outer, "outer", recompute=False)(x).sum()

    torch._dynamo.reset()
    run = torch.compile(remat.checkpoint(region_name="blk")(body), backend="aot_eager")
    with pytest.raises(Exception) as info:  # noqa: B017 - Dynamo wraps it
        run(_x())
    assert PHRASES["recompute_in_save"] in str(info.value), str(info.value)
