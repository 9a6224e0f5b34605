"""The memory-budget planner's solver: a multiple-choice knapsack, exactly.

The problem
-----------
``n`` blocks; block ``b`` has candidates ``c = 0 .. k_b - 1`` (full recompute, keep
some submodules as save regions, no checkpoint), each with measured saved bytes
``w[b][c]`` (an int) and recompute time ``t[b][c]`` (seconds). Choose one candidate
per block so that ``sum w <= capacity`` and ``sum t`` is smallest. This is the
multiple-choice knapsack problem (NP-hard in general: bytes are arbitrary ints).

The algorithm: a Pareto-frontier dynamic programme
-------------------------------------------------
After blocks ``0 .. b`` the solver keeps the *frontier*: every partial plan that no
other partial plan beats on both bytes and time (fewer-or-equal bytes and
less-or-equal time), and that fits the capacity. Extending each frontier point by
each candidate of the next block and pruning dominated points again gives the next
frontier; the optimum is the frontier's fastest point at the end. A dominated
partial plan can never complete to a strictly better plan than the one dominating
it (the same completion fits and is no slower), so this is exact.

Cost: ``O(n * k * F * log(k * F))`` time and ``O(n * F)`` memory (parent pointers
for the plan), where ``F`` is the largest frontier. ``F`` is at most the number of
distinct byte totals that fit (at most ``capacity + 1``) and at most ``prod(k_b)``;
in practice it is small: the blocks of a transformer are alike, so many partial plans
reach the same byte total and collapse into one point (6 GPT blocks with 5 candidates
each give frontiers of a few dozen points, 15625 plans in all).

Above :data:`MAX_FRONTIER` points (heterogeneous blocks by the hundred) the frontier
is thinned: the capacity is cut into :data:`MAX_FRONTIER` equal byte buckets and
each bucket keeps its fastest point. Every kept point is a real partial plan with its
true bytes, so the result always fits the budget; it may then miss the optimum by at
most the time difference between points inside one bucket (bytes within
``capacity / MAX_FRONTIER`` of each other). Up to that size the result is exact, which
``tests/fsdp/test_budget.py`` checks against brute force over all ``prod(k_b)`` plans.

Ties (equal total time) go to fewer bytes, then to a fixed order of the partial
plans (no hashing, no set iteration), so the same table gives the same plan on every
rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = ["MAX_FRONTIER", "brute_force", "frontier", "plan_cost", "solve"]

MAX_FRONTIER = 4096
"""Frontier points kept per block before thinning (see the module docstring)."""

Costs = Sequence[Sequence[tuple[int, float]]]
"""``costs[b][c] = (bytes, seconds)`` of candidate ``c`` of block ``b``."""


def plan_cost(costs: Costs, choice: Sequence[int]) -> tuple[int, float]:
    """``(total bytes, total seconds)`` of one choice vector."""
    total_b, total_t = 0, 0.0
    for b, c in enumerate(choice):
        w, t = costs[b][c]
        total_b += w
        total_t += t
    return total_b, total_t


def solve(costs: Costs, capacity: int) -> list[int] | None:
    """The choice vector (one candidate index per block) of least total time whose
    total bytes fit ``capacity``; None when even the smallest choice does not fit."""
    points = frontier(costs, capacity)
    return None if not points else points[-1][2]


def frontier(costs: Costs, capacity: int) -> list[tuple[int, float, list[int]]]:
    """Every plan that fits ``capacity`` and that no other beats on both bytes
    and time, as ``(bytes, seconds, choice)``: bytes ascending, seconds strictly
    descending (the last is :func:`solve`'s answer); empty when none fits."""
    if capacity < 0:
        return []
    # One layer per block: parallel lists (bytes, time, parent index, choice).
    layers: list[tuple[list[int], list[float], list[int], list[int]]] = []
    cur_b, cur_t = [0], [0.0]
    for block in costs:
        cand = []
        for i, (wb, tb) in enumerate(zip(cur_b, cur_t)):
            for c, (w, t) in enumerate(block):
                nb = wb + w
                if nb <= capacity:
                    cand.append((nb, tb + t, i, c))
        if not cand:
            return []
        # bytes ascending, then time, then the (parent, choice) order: deterministic
        cand.sort()
        nb_l, nt_l, np_l, nc_l = [], [], [], []
        best = float("inf")
        for nb, nt, p, c in cand:
            if nt < best:  # strictly faster than every point with fewer bytes
                best = nt
                nb_l.append(nb)
                nt_l.append(nt)
                np_l.append(p)
                nc_l.append(c)
        if len(nb_l) > MAX_FRONTIER:
            nb_l, nt_l, np_l, nc_l = _thin(nb_l, nt_l, np_l, nc_l, capacity)
        layers.append((nb_l, nt_l, np_l, nc_l))
        cur_b, cur_t = nb_l, nt_l
    if not layers:
        return [(0, 0.0, [])]
    out = []
    last_b, last_t = layers[-1][0], layers[-1][1]
    for end in range(len(last_b)):
        idx, choice = end, []
        for _nb, _nt, np_l, nc_l in reversed(layers):
            choice.append(nc_l[idx])
            idx = np_l[idx]
        choice.reverse()
        out.append((last_b[end], last_t[end], choice))
    return out


def _thin(
    nb: list[int], nt: list[float], np_: list[int], nc: list[int], capacity: int
) -> tuple[list[int], list[float], list[int], list[int]]:
    width = max(1, -(-(capacity + 1) // MAX_FRONTIER))
    out: dict[int, int] = {}
    for i, b in enumerate(nb):
        out[b // width] = i  # later points in a bucket are faster
    keep = sorted(out.values())
    return (
        [nb[i] for i in keep],
        [nt[i] for i in keep],
        [np_[i] for i in keep],
        [nc[i] for i in keep],
    )


def brute_force(costs: Costs, capacity: int) -> list[int] | None:
    """Every choice vector tried (``prod(k_b)`` of them): the reference for tests."""
    best: tuple[float, int, tuple[int, ...]] | None = None
    for choice in itertools.product(*(range(len(block)) for block in costs)):
        w, t = plan_cost(costs, choice)
        if w <= capacity and (best is None or (t, w, choice) < best):
            best = (t, w, choice)
    return None if best is None else list(best[2])
