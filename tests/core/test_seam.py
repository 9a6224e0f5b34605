"""The core's extension surface as a layer above uses it: declared options, the
checkpoint's phase, the packed-object classifier."""

from __future__ import annotations

import pytest
import torch

import remat_dist as remat
from remat_dist import RematUsageError
from remat_dist.core import (
    CheckpointPhase,
    OptionSpec,
    PackedKind,
    classify_packed,
    declare_option,
    live_records,
    observers_suspended,
    records_of_node,
    register_observer,
)


def _tag(value, where):
    if not isinstance(value, str):
        raise RematUsageError(f"{where}: tag must be a string")
    return value.upper()


def test_a_declared_option_reaches_the_record_and_its_regions():
    handle = declare_option(
        OptionSpec("tag", default="none", validate=_tag, doc="test", region=True)
    )
    try:
        x = torch.randn(3, requires_grad=True)

        def body(t):
            return remat.region(torch.sin, "r", recompute=True, tag="inner")(t).cos()

        y = remat.checkpoint(region_name="seam_opt", tag="outer")(body)(x)
        (record,) = [r for r in live_records() if r.name == "seam_opt"]
        assert record.options.get("tag") == "OUTER"  # validated by its declarer
        assert record.regions[0].options["tag"] == "INNER"
        with pytest.raises(RematUsageError, match="tag must be a string"):
            remat.checkpoint(region_name="seam_bad", tag=3)
        y.sum().backward()
    finally:
        handle.remove()
    with pytest.raises(RematUsageError, match=r"unsupported option\(s\) tag\.") as info:
        remat.checkpoint(region_name="seam_gone", tag="x")
    assert "collectives" in str(info.value)  # lists what is declared now


def test_the_phase_follows_forward_replay_and_early_stop():
    seen = []

    class Phases:
        def on_checkpoint_start(self, record, replay):
            seen.append(("start", record.phase))

        def on_checkpoint_end(self, record, replay, error):
            seen.append(("end", record.phase))

    handle = register_observer(Phases())
    try:
        x = torch.randn(3, requires_grad=True)
        y = remat.checkpoint(region_name="seam_phase")(lambda t: t.sin().exp().cos())(x)
        (record,) = [r for r in live_records() if r.name == "seam_phase"]
        assert record.phase is CheckpointPhase.WAITING and not record.replaying
        y.sum().backward()
    finally:
        handle.remove()
    assert seen == [
        ("start", CheckpointPhase.FORWARD),
        ("end", CheckpointPhase.WAITING),
        ("start", CheckpointPhase.REPLAYING),
        ("end", CheckpointPhase.STOPPED_EARLY),  # cos's input is the last save
    ]


def test_the_classifier_finds_what_a_save_region_keeps():
    x = torch.randn(4, 4, requires_grad=True)

    def body(t):
        h = remat.region(lambda u: u.exp(), "kept", recompute=False)(t)
        remat.recompute_needs_tensor(h)
        return h.sin()

    y = remat.checkpoint(region_name="seam_cls")(body)(x)
    kinds, stack, seen = [], [y.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for name in dir(node):
            if name.startswith("_raw_saved_"):
                raw = getattr(node, name)
                for item in raw if isinstance(raw, tuple) else (raw,):
                    packed = getattr(item, "data", None) if hasattr(item, "register_hooks") else None
                    hit = classify_packed(packed) if packed is not None else None
                    if hit is not None:
                        kinds.append(hit[0])
        stack.extend(n for n, _ in node.next_functions)
    assert PackedKind.REGION_KEPT in kinds
    assert [r.name for r in records_of_node(y.grad_fn)] == ["seam_cls"]


def test_observers_suspended_leaves_the_checkpoints_of_its_block_unobserved():
    seen = []

    class Events:
        def on_checkpoint_start(self, record, replay):
            seen.append((record.name, "replay" if replay else "forward"))

    handle = register_observer(Events())
    try:
        x = torch.randn(4, requires_grad=True)
        block = remat.checkpoint(region_name="quiet")(lambda t: t.sin().cos())
        with observers_suspended():
            y = block(x)
        assert seen == []
        y.sum().backward()  # the observer is back, and sees the replay start
        reference = torch.autograd.grad(x.sin().cos().sum(), x)[0]
        assert torch.equal(x.grad, reference)
        assert seen == [("quiet", "replay")]
        seen.clear()
        block(x).sum().backward()  # after the block: observed again
        assert seen == [("quiet", "forward"), ("quiet", "replay")]
    finally:
        handle.remove()
