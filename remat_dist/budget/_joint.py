"""One budget over several models on a rank: the joint problem the planner solves
when a ``MemoryBudget`` object is shared by several models (the stage modules of
an interleaved pipeline schedule), and by one model alone (a problem of one).

Each model ``m`` comes with its table, already the maxima over the ranks that run
it alike: per block and candidate ``(bytes, seconds)``, the bytes it saves
outside its blocks, and ``k_m``, the most of its forwards alive at once in the
profiling step. What is bounded is

    sum over m of k_m x (outside_m + the bytes of m's chosen candidates)  <=  budget

an upper bound of the rank's peak: each model's peak is reached with ``k_m``
forwards alive, and the models' peaks may not fall at the same moment of the
step (then the rank keeps less). With every block weighted by its model's
``k_m`` this is one multiple-choice knapsack over all the blocks of all the
models, solved exactly by ``_solver.solve``: the plan of least summed recompute
time that fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from remat_dist._errors import RematUsageError
from remat_dist.budget._profile import human
from remat_dist.budget._solver import solve

__all__ = ["ModelTable", "describe_least", "smallest_peak", "solve_jointly"]


@dataclass(frozen=True)
class ModelTable:
    """One model's share of the joint problem.

    Attributes:
        name: the model in words (``the model of blocks 'layers.0'..'layers.1'``).
        labels: per block, its candidates' decisions (``"full"`` first,
            ``"none"`` last).
        costs: per block and candidate, ``(bytes, seconds)``.
        outside: bytes one forward saves outside the blocks.
        in_flight: ``k``, the most forwards alive at once.
        needs_most: for an error, who among the model's ranks needs most
            (``"rank 1 needs most: 123 bytes, "``; empty on one rank).
    """

    name: str
    labels: list[list[str]]
    costs: list[list[tuple[int, float]]]
    outside: int
    in_flight: int
    needs_most: str = ""


def smallest_peak(table: ModelTable) -> int:
    """The model's peak with every block at its fewest bytes."""
    k = table.in_flight
    return k * (table.outside + sum(min(w for w, _ in block) for block in table.costs))


def describe_least(labels: Sequence[str]) -> str:
    """The plan of least bytes in words (its decision per block)."""
    if all(label == "full" for label in labels):
        return "every block recomputed in full"
    counts: dict[str, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    parts = [f"{label!r} for {n} block{'s' if n > 1 else ''}" for label, n in counts.items()]
    return "each block at its fewest bytes: " + ", ".join(parts)


def _least(table: ModelTable) -> list[str]:
    return [
        table.labels[b][min(range(len(blk)), key=lambda c: blk[c][0])]
        for b, blk in enumerate(table.costs)
    ]


def solve_jointly(tables: Sequence[ModelTable], budget: int) -> list[list[int]]:
    """Per model, per block, the index of the chosen candidate: least summed
    recompute time with ``sum k_m x (outside_m + blocks_m) <= budget``. Raises
    :class:`RematUsageError` when even every block at its fewest bytes does not
    fit, naming every model, its forwards in flight, its peak at full recompute
    and the budget."""
    smallest = sum(smallest_peak(t) for t in tables)
    if budget < smallest:
        raise RematUsageError(_infeasible(tables, budget, smallest))
    everything = sum(
        t.in_flight * (t.outside + sum(block[-1][0] for block in t.costs)) for t in tables
    )
    if budget >= everything:
        return [[len(block) - 1 for block in t.costs] for t in tables]  # "none" last
    scaled = [
        [(t.in_flight * w, s) for w, s in block] for t in tables for block in t.costs
    ]
    found = solve(scaled, budget - sum(t.in_flight * t.outside for t in tables))
    assert found is not None  # feasible: checked above
    out, at = [], 0
    for t in tables:
        out.append(list(found[at : at + len(t.costs)]))
        at += len(t.costs)
    return out


def _infeasible(tables: Sequence[ModelTable], budget: int, smallest: int) -> str:
    fix = (
        f"Fix: MemoryBudget(bytes={smallest}) or more, a smaller batch per rank (or "
        "micro-batch), or finer blocks."
    )
    if len(tables) == 1:
        t = tables[0]
        return (
            f"remat_dist.MemoryBudget: a budget of {budget:,} bytes ({human(budget)}) "
            f"cannot be met on {t.name}, with {t.in_flight} forward(s) alive at once "
            f"at its peak: its peak at full recompute, the smallest feasible budget is "
            f"{smallest:,} bytes ({human(smallest)}), {describe_least(_least(t))} "
            f"({t.needs_most}{t.in_flight} x {t.outside:,} bytes of it outside the "
            "blocks). The gradients of this profiling step are right, but do not go on "
            f"with this budget. {fix}"
        )
    each = "; ".join(
        f"{t.name}: {smallest_peak(t):,} bytes ({human(smallest_peak(t))}) with "
        f"{t.in_flight} forward(s) alive, {describe_least(_least(t))}"
        + (f" ({t.needs_most.rstrip(', ')})" if t.needs_most else "")
        for t in tables
    )
    return (
        f"remat_dist.MemoryBudget: a budget of {budget:,} bytes ({human(budget)}) "
        f"shared by {len(tables)} models on this rank cannot be met: their peaks at "
        f"full recompute are {each}; together {smallest:,} bytes ({human(smallest)}), "
        "the smallest feasible budget for this rank. The gradients of this profiling "
        "step are right, but do not go on with this budget. " + fix
    )
