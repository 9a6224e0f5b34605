"""Brute force over a shared budget's plans, for the tests: every candidate of
every block of every model sharing the budget, the rank's peak at each moment
the profiling step showed (``BudgetPlan.concurrent``)."""

from __future__ import annotations

import itertools


def fixed(plan) -> int:
    """Bytes per forward whatever the plan: outside the blocks and the loss."""
    return plan.outside_bytes + plan.loss_bytes


def joint_bounds(plans) -> tuple[int, int]:
    """The rank's peak with every block at its fewest bytes and at its most."""
    moments = plans[0].concurrent
    least = [fixed(p) + sum(min(w for w, _ in b.candidates.values()) for b in p.blocks)
             for p in plans]
    most = [fixed(p) + sum(b.candidates["none"][0] for b in p.blocks) for p in plans]
    return (max(sum(n * x for n, x in zip(v, least)) for v in moments),
            max(sum(n * x for n, x in zip(v, most)) for v in moments))


def joint_optimum(plans, budget: int) -> float:
    """The least recompute time whose peak at every moment fits ``budget``."""
    blocks = [(m, b) for m, p in enumerate(plans) for b in p.blocks]
    best = None
    for combo in itertools.product(*(list(b.candidates.values()) for _, b in blocks)):
        per = [fixed(p) for p in plans]
        for (m, _), (w, _) in zip(blocks, combo):
            per[m] += w
        peak = max(sum(n * x for n, x in zip(v, per)) for v in plans[0].concurrent)
        t = sum(t for _, t in combo)
        if peak <= budget and (best is None or t < best):
            best = t
    assert best is not None
    return best
