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
