"""One budget over several models on a rank: the joint problem the planner solves
when a ``MemoryBudget`` object is shared by several models (the stage modules of
an interleaved or V-shaped pipeline schedule), and by one model alone (a problem
of one).

Each model ``m`` comes with its table, already the maxima over the ranks that run
it alike: per block and candidate ``(bytes, seconds)``, the bytes one forward
saves outside its blocks and after it (the loss), and ``k_m``, the most of its
forwards alive at once in the profiling step. The profiling step also gives the
**concurrent counts**: at each forward's end, how many forwards of each model
were alive at that moment (a vector ``v``, one count per model). With ``B_m``
the bytes of one forward of ``m`` under a plan, the rank's peak is

    max over the observed v of  sum over m of v_m x B_m

and that is what must fit the budget: the peak that happens, not the sum of
the models' own peaks ``sum k_m x B_m``, which the schedule may never reach
(the models' peaks need not coincide). With one model, or one vector, this is
one multiple-choice knapsack, every block weighted by its model's count, solved
exactly by ``_solver.solve``. With several vectors each model's Pareto frontier
(``_solver.frontier``) is computed alone and the frontiers are combined, every
vector checked: exact too, as long as the product of the frontiers stays under
:data:`MAX_COMBINATIONS`; past it the models plan against the vector of their
own peaks (the sum bound, still safe).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from remat_dist._errors import RematUsageError
from remat_dist.budget._profile import human
from remat_dist.budget._solver import frontier, solve

__all__ = [
    "MAX_COMBINATIONS",
    "ModelTable",
    "describe_least",
    "maximal",
    "moments",
    "peak_of",
    "smallest_peak",
    "solve_jointly",
]

MAX_COMBINATIONS = 1_000_000
"""Most combinations of the models' frontiers tried for several concurrent
counts (past it: the sum bound)."""


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
        after: bytes saved after one forward returns and before the next
            forward of a model under a budget (the loss).
        needs_most: for an error, who among the model's ranks needs most
            (``"rank 1 needs most: 123 bytes, "``; empty on one rank).
    """

    name: str
    labels: list[list[str]]
    costs: list[list[tuple[int, float]]]
    outside: int
    in_flight: int
    needs_most: str = ""
    after: int = 0

    @property
    def fixed(self) -> int:
        """Bytes one forward saves whatever the plan: outside the blocks and
        after the forward (the loss)."""
        return self.outside + self.after


def smallest_peak(table: ModelTable) -> int:
    """The model's peak with every block at its fewest bytes."""
    k = table.in_flight
    return k * (table.fixed + sum(min(w for w, _ in block) for block in table.costs))


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


def maximal(vectors: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The vectors no other one reaches or exceeds in every count, sorted (the
    others can never hold the peak)."""
    vs = sorted({tuple(v) for v in vectors})
    return [
        v for v in vs
        if not any(u != v and all(a >= b for a, b in zip(u, v)) for u in vs)
    ]


def peak_of(per_forward: Sequence[int], vectors: Sequence[Sequence[int]]) -> int:
    """The rank's peak for these bytes per forward of each model."""
    return max(sum(n * b for n, b in zip(v, per_forward)) for v in vectors)


def solve_jointly(
    tables: Sequence[ModelTable],
    budget: int,
    concurrent: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """Per model, per block, the index of the chosen candidate: least summed
    recompute time whose peak, :func:`peak_of` over the ``concurrent`` counts
    (default: each model at its ``in_flight`` at once, the sum bound), fits
    ``budget``. Raises :class:`RematUsageError` when even every block at its
    fewest bytes does not fit, naming every model, its forwards in flight, its
    peak at full recompute and the budget."""
    vectors = moments(tables, concurrent)
    least = [t.fixed + sum(min(w for w, _ in block) for block in t.costs) for t in tables]
    smallest = peak_of(least, vectors)
    if budget < smallest:
        raise RematUsageError(_infeasible(tables, budget, smallest, vectors))
    most = [t.fixed + sum(block[-1][0] for block in t.costs) for t in tables]
    if budget >= peak_of(most, vectors):
        return [[len(block) - 1 for block in t.costs] for t in tables]  # "none" last
    if len(vectors) == 1:
        return _one_vector(tables, budget, vectors[0])
    found = _combine(tables, budget, vectors, least)
    if found is None:  # too many combinations: the sum bound, still safe
        return solve_jointly(tables, budget, [tuple(t.in_flight for t in tables)])
    return found


def moments(
    tables: Sequence[ModelTable], concurrent: Sequence[Sequence[int]] | None,
    plan_against: str = "peak",
) -> list[tuple[int, ...]]:
    """The maximal concurrent counts to plan against: those observed, each
    model at least once at its own ``in_flight`` (the ranks' maxima may exceed
    what this rank saw); every model at its peak at once without counts or
    with ``plan_against="sum"`` (``MemoryBudget.plan_against``)."""
    own = tuple(t.in_flight for t in tables)
    if concurrent is None or plan_against == "sum" or not concurrent:
        return [own]
    vs = [tuple(v) for v in concurrent if len(v) == len(tables)]
    # each model's own peak is among the moments seen; a model the counts
    # missed (it never ran while the others were followed) counts alone
    for m, t in enumerate(tables):
        if not any(v[m] >= t.in_flight for v in vs):
            vs.append(tuple(t.in_flight if i == m else 0 for i in range(len(tables))))
    return maximal(vs)


def _one_vector(
    tables: Sequence[ModelTable], budget: int, v: Sequence[int]
) -> list[list[int]]:
    scaled = [[(n * w, s) for w, s in block] for t, n in zip(tables, v) for block in t.costs]
    found = solve(scaled, budget - sum(n * t.fixed for t, n in zip(tables, v)))
    assert found is not None  # feasible: checked by the caller
    out, at = [], 0
    for t in tables:
        out.append(list(found[at : at + len(t.costs)]))
        at += len(t.costs)
    return out


def _combine(
    tables: Sequence[ModelTable],
    budget: int,
    vectors: Sequence[Sequence[int]],
    least: Sequence[int],
) -> list[list[int]] | None:
    """Each model's frontier alone, then every combination of one point per
    model checked against every vector: the fastest that fits (ties: fewer
    bytes, then the frontiers' order). None past :data:`MAX_COMBINATIONS`."""
    fronts = []
    for m, t in enumerate(tables):
        # the most block bytes m can take with every other model at its least
        room = min(
            (budget - peak_part(least, v, m)) // v[m] - t.fixed for v in vectors if v[m] > 0
        )
        fronts.append(frontier(t.costs, room))
    size = 1
    for f in fronts:
        size *= max(1, len(f))
    if size > MAX_COMBINATIONS:
        return None
    best: tuple[float, int] | None = None
    chosen: tuple[int, ...] | None = None
    ranges = [range(len(f)) for f in fronts]
    for combo in _product(ranges):
        per = [t.fixed + fronts[m][i][0] for m, (t, i) in enumerate(zip(tables, combo))]
        peak = peak_of(per, vectors)
        if peak > budget:
            continue
        key = (sum(fronts[m][i][1] for m, i in enumerate(combo)), peak)
        if best is None or key < best:
            best, chosen = key, combo
    assert chosen is not None  # the least of each model fits: checked by the caller
    return [list(fronts[m][i][2]) for m, i in enumerate(chosen)]


def peak_part(per_forward: Sequence[int], v: Sequence[int], m: int) -> int:
    """``v``'s bytes of every model but ``m``."""
    return sum(n * b for i, (n, b) in enumerate(zip(v, per_forward)) if i != m)


def _product(ranges: Sequence[range]) -> itertools.product[tuple[int, ...]]:
    return itertools.product(*ranges)


def _loss_words(t: ModelTable) -> str:
    if not t.after:
        return ""
    return f" and {t.in_flight} x {t.after:,} bytes saved after the forward, by the loss"


def _counts_words(vectors: Sequence[Sequence[int]]) -> str:
    shown = " or ".join(str(list(v)) for v in vectors)
    return f"forwards alive at once per model at the rank's peak {shown}"


def _infeasible(
    tables: Sequence[ModelTable], budget: int, smallest: int, vectors: Sequence[Sequence[int]]
) -> str:
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
            f"blocks{_loss_words(t)}). The gradients of this profiling step are right, but do not go on "
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
        f"full recompute are {each}; together {smallest:,} bytes ({human(smallest)}) "
        f"with {_counts_words(vectors)}, the smallest feasible budget for this rank. The gradients of this profiling "
        "step are right, but do not go on with this budget. " + fix
    )
