"""The plan digest ranks compare depends only on the plan, never on when a rank
read it: entries are hashed in batches, and a read in between hashes what is
pending."""

from __future__ import annotations

from remat_dist.distributed._plan import PlanDigest


def _entries(n: int) -> list[tuple[str, None, tuple[()]]]:
    return [(f"layers.{i % 7}", None, ()) for i in range(n)]


def test_a_rank_that_reads_its_digest_midway_still_agrees_with_one_that_does_not():
    reader, quiet = PlanDigest(), PlanDigest()
    for i, entry in enumerate(_entries(700)):  # across two hashing batches
        reader.add(entry, {})
        quiet.add(entry, {})
        if i in (0, 99, 255, 256, 511):
            reader.value()
    assert reader.value() == quiet.value()
    assert reader.words() == quiet.words()


def test_one_entry_more_another_order_or_another_last_entry_changes_the_digest():
    entries = _entries(300)  # one batch hashed, the rest pending when read
    same, longer, swapped, last = PlanDigest(), PlanDigest(), PlanDigest(), PlanDigest()
    for entry in entries:
        same.add(entry, {})
        longer.add(entry, {})
    longer.add(entries[0], {})
    for entry in [entries[1], entries[0], *entries[2:]]:
        swapped.add(entry, {})
    for entry in [*entries[:-1], ("lm_head", None, ())]:
        last.add(entry, {})
    reference = PlanDigest()
    for entry in entries:
        reference.add(entry, {})
    assert same.value() == reference.value()
    assert longer.value() != reference.value()
    assert swapped.value() != reference.value()
    assert last.value() != reference.value()


def test_an_entry_changed_after_it_was_added_does_not_change_the_digest():
    # entries are kept until their batch is hashed: a plan given as a list (a
    # checkpoint with regions) is frozen when added, not when hashed
    plan = ["layers.0", None, [["attention", "save"]]]
    kept, reference = PlanDigest(), PlanDigest()
    kept.add(plan, {})
    reference.add(["layers.0", None, [["attention", "save"]]], {})
    plan[2][0][1] = "recompute"
    assert kept.value() == reference.value()
    changed = PlanDigest()
    changed.add(plan, {})
    assert changed.value() != reference.value()


def _ledger(shape: tuple[int, ...], op: str = "allreduce_", desc: str = "tp"):
    import torch

    from remat_dist.distributed._ledger import CollectiveEntry, CollectiveLedger
    from remat_dist.distributed._optable import TensorMeta, _spec_for

    spec = _spec_for(op, getattr(torch.ops.c10d, op).default)
    meta = (TensorMeta(shape, torch.float32, torch.device("cpu")),)
    entry = CollectiveEntry(
        position=0, op=op, group_name="1", group_ranks=(0, 1), group_desc=desc,
        inputs=meta, outputs=meta, params=(("reduce_op", "SUM"),), _spec=spec,
    )
    return CollectiveLedger([entry])


def test_a_ledger_seen_before_gets_its_own_fingerprints_and_the_memo_stays_bounded():
    import torch.distributed  # noqa: F401  (registers the c10d ops)

    from remat_dist.distributed._ledger import _FINGERPRINTS, _FINGERPRINTS_KEPT

    first = _ledger((4, 64)).group_fingerprints()
    assert _ledger((4, 65)).group_fingerprints() != first
    assert _ledger((4, 64), desc="dp").group_fingerprints() != first
    assert _ledger((4, 64)).group_fingerprints() == first  # served from the memo
    assert first == _ledger((4, 64))._group_fingerprints()  # as computed afresh
    for n in range(2 * _FINGERPRINTS_KEPT):  # a job whose shapes never repeat
        _ledger((n, 8)).group_fingerprints()
        assert len(_FINGERPRINTS) <= _FINGERPRINTS_KEPT
