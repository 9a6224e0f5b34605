"""The cross-rank saved-tensor report: per-rank summaries gathered to one rank.

Each rank builds its :func:`saved_tensors_summary`; one ``all_gather_objects`` brings
them to ``dst``, where :func:`aggregate_summaries` (a pure function, testable
without processes) turns them into a :class:`CrossRankReport`: per region the
bytes on every rank with min / median / max, the heaviest rank and the imbalance
(max / mean), and the same for the per-rank totals.

Rank sections: a layer above the report (which the report may not import) adds a
part of its own to every rank's summary through :func:`add_rank_section`; the
composition root wires the memory budget's (``remat_dist.budget._summary``), which
the report reads as plain data into a :class:`BudgetReport`: per rank its stage
models, their plans and forwards in flight, the budget and the measured peak,
and over the ranks min / median / max of the peaks and their imbalance.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from remat_dist.distributed import all_gather_objects, dist_ready
from remat_dist.report._format import compress_ints, compress_names, format_bytes, table

__all__ = [
    "BudgetReport",
    "CrossRankReport",
    "RankBudget",
    "StagePlan",
    "add_rank_section",
    "RankTotals",
    "RegionStats",
    "Stats",
    "aggregate_summaries",
    "gather_saved_tensors_report",
]

MAX_RANK_LINES = 8
"""Above this many distinct rank lines, the format shows the heaviest and lightest."""
MAX_REGION_LINES = 12
"""Above this many region lines, the format shows the heaviest (by max bytes)."""


_SECTIONS: dict[str, Callable[[], Any]] = {}
"""Extra per-rank parts of the summary, by key (:func:`add_rank_section`)."""


def add_rank_section(key: str, source: Callable[[], Any]) -> None:
    """Add ``source()`` (JSON-able data, or None for nothing) to every rank's
    summary under ``key`` at each :func:`gather_saved_tensors_report`. The seam
    through which a layer above the report, which the report may not import,
    shows its per-rank state (the composition root wires the memory budget's
    under ``"budget"``). Adding a key again replaces its source."""
    _SECTIONS[key] = source


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


@dataclass(frozen=True)
class Stats:
    """min / median / max of one quantity over the ranks, the rank holding the max
    (the lowest such rank) and the imbalance max / mean (1.0 when all are 0)."""

    min: int | float
    median: int | float
    max: int | float
    max_rank: int
    imbalance: float

    @classmethod
    def of(cls, values: Sequence[int | float], ranks: Sequence[int]) -> Stats:
        if not values:
            return cls(0, 0, 0, -1, 1.0)
        top = max(values)
        mean = sum(values) / len(values)
        return cls(
            min=_number(min(values)),
            median=_number(statistics.median(values)),
            max=_number(top),
            max_rank=ranks[list(values).index(top)],
            imbalance=float(top / mean) if mean else 1.0,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "min": self.min,
            "median": self.median,
            "max": self.max,
            "max_rank": self.max_rank,
            "imbalance": self.imbalance,
        }


@dataclass(frozen=True)
class RankTotals:
    """One rank's totals (``total == regions + inputs + outside``)."""

    rank: int
    total_bytes: int
    outside_regions_bytes: int
    checkpoint_input_bytes: int

    @property
    def regions_bytes(self) -> int:
        return (
            self.total_bytes - self.outside_regions_bytes - self.checkpoint_input_bytes
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "total_bytes": self.total_bytes,
            "outside_regions_bytes": self.outside_regions_bytes,
            "checkpoint_input_bytes": self.checkpoint_input_bytes,
        }


@dataclass(frozen=True)
class RegionStats:
    """One region (checkpoint ``region_name``): its bytes on each rank, in the order
    of :attr:`CrossRankReport.ranks`, and their statistics. ``bytes`` is what the
    checkpoint keeps beyond its inputs (save regions, persisted outputs);
    ``input_bytes`` its inputs on each rank (counted in the ranks'
    ``checkpoint_input_bytes``), so a fully recomputed block shows its real cost."""

    name: str
    bytes: tuple[int, ...]
    stats: Stats
    input_bytes: tuple[int, ...] = ()

    @property
    def min(self) -> int | float:
        return self.stats.min

    @property
    def median(self) -> int | float:
        return self.stats.median

    @property
    def max(self) -> int | float:
        return self.stats.max

    @property
    def max_rank(self) -> int:
        return self.stats.max_rank

    @property
    def imbalance(self) -> float:
        return self.stats.imbalance

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bytes": list(self.bytes),
            **self.stats.to_dict(),
            "input_bytes": list(self.input_bytes or (0,) * len(self.bytes)),
        }


@dataclass(frozen=True)
class StagePlan:
    """One model (a pipeline stage module) under a memory budget on one rank.

    Attributes:
        name: the model by its blocks (``the model of blocks 'layers.0'..'layers.1'``).
        blocks: its blocks' names.
        in_flight: the most of its forwards alive at once in the profiling step,
            the ``k`` its plan is made for (None: not planned yet).
        decisions: ``(block, decision)`` per block (empty: not planned yet).
        predicted_peak_bytes: ``k x`` its bytes per forward under the plan.
    """

    name: str
    blocks: tuple[str, ...]
    in_flight: int | None
    decisions: tuple[tuple[str, str], ...]
    predicted_peak_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "blocks": list(self.blocks),
            "in_flight": self.in_flight,
            "decisions": [list(d) for d in self.decisions] if self.decisions else None,
            "predicted_peak_bytes": self.predicted_peak_bytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StagePlan:
        k, pred = d.get("in_flight"), d.get("predicted_peak_bytes")
        return cls(
            name=str(d["name"]),
            blocks=tuple(str(b) for b in d.get("blocks", ())),
            in_flight=None if k is None else int(k),
            decisions=tuple((str(b), str(c)) for b, c in d.get("decisions") or ()),
            predicted_peak_bytes=None if pred is None else int(pred),
        )


@dataclass(frozen=True)
class RankBudget:
    """One rank under memory budgets: what it may keep, what its plans bound and
    what it kept. A rank with several ``MemoryBudget`` objects (several budgets)
    shows their sums; one object shared by its stage modules is one budget.

    Attributes:
        rank: the global rank.
        budget_bytes: the budget.
        peak_bytes: the most activation bytes alive at once on this rank since
            the previous report, every forward of its models counted (None: not
            measured: ``MemoryBudget(measure_peak=False)``, or not planned yet).
        predicted_peak_bytes: what its plans bound (the sum over its models of
            ``k x`` bytes per forward).
        stages: its models, in ``apply_remat`` order.
        loss_bytes_at_peak: of ``peak_bytes``, the bytes saved after a forward
            (the loss) at that moment (None: not measured).
    """

    rank: int
    budget_bytes: int
    peak_bytes: int | None
    predicted_peak_bytes: int
    stages: tuple[StagePlan, ...]
    loss_bytes_at_peak: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "budget_bytes": self.budget_bytes,
            "peak_bytes": self.peak_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "stages": [st.to_dict() for st in self.stages],
            "loss_bytes_at_peak": self.loss_bytes_at_peak,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankBudget:
        peak = d.get("peak_bytes")
        loss = d.get("loss_bytes_at_peak")
        return cls(
            rank=int(d["rank"]),
            budget_bytes=int(d["budget_bytes"]),
            peak_bytes=None if peak is None else int(peak),
            predicted_peak_bytes=int(d.get("predicted_peak_bytes", 0)),
            stages=tuple(StagePlan.from_dict(st) for st in d.get("stages", ())),
            loss_bytes_at_peak=None if loss is None else int(loss),
        )


@dataclass(frozen=True)
class BudgetReport:
    """The memory budgets across ranks: per rank (sorted by rank) its
    :class:`RankBudget`, and the statistics of the measured peaks (over the ranks
    that measured one; None when none did)."""

    ranks: tuple[RankBudget, ...]
    peaks: Stats | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": [r.to_dict() for r in self.ranks],
            "peaks": None if self.peaks is None else self.peaks.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BudgetReport:
        peaks = d.get("peaks")
        return cls(
            tuple(RankBudget.from_dict(r) for r in d["ranks"]),
            None if peaks is None else _stats_from(peaks),
        )

    @classmethod
    def of(cls, sections: Sequence[tuple[int, Mapping[str, Any]]]) -> BudgetReport:
        """From ``(rank, section)`` pairs, the ``"budget"`` sections of the ranks'
        summaries (``remat_dist.budget._summary`` gives their shape)."""
        ranks = []
        for rank, section in sorted(sections, key=lambda x: x[0]):
            budgets = list(section.get("budgets", ()))
            peaks = [b.get("peak_bytes") for b in budgets]
            ranks.append(RankBudget(
                rank=rank,
                budget_bytes=sum(int(b["budget"]) for b in budgets),
                peak_bytes=None if any(p is None for p in peaks) or not peaks
                else sum(int(p) for p in peaks),
                predicted_peak_bytes=sum(int(b.get("predicted_peak_bytes", 0)) for b in budgets),
                stages=tuple(StagePlan.from_dict(m) for b in budgets for m in b.get("models", ())),
                loss_bytes_at_peak=None if any(p is None for p in peaks) or not peaks
                else sum(int(b.get("loss_bytes_at_peak") or 0) for b in budgets),
            ))
        measured = [r for r in ranks if r.peak_bytes is not None]
        peaks = (
            Stats.of([r.peak_bytes for r in measured], [r.rank for r in measured])  # type: ignore[misc]
            if measured else None
        )
        return cls(tuple(ranks), peaks)

    def format(self) -> str:
        """The peaks over the ranks, then per rank its peak against its budget and
        the plan of each of its models."""
        p = self.peaks
        if p is None:
            head = (
                f"memory budget on {len(self.ranks)} rank(s): peaks not measured "
                "(MemoryBudget(bytes=..., measure_peak=True) measures them)"
            )
        else:
            head = (
                f"memory budget, peak per rank since the previous report: max "
                f"{format_bytes(p.max)} on rank {p.max_rank}, median {format_bytes(p.median)}, "
                f"min {format_bytes(p.min)}, imbalance {p.imbalance:.2f} (max/mean)"
            )
        lines = [head]
        for r in self.ranks:
            if r.peak_bytes is None:
                peak = "peak not measured"
            else:
                share = r.peak_bytes / r.budget_bytes * 100 if r.budget_bytes else 0.0
                peak = f"peak {format_bytes(r.peak_bytes)} = {share:.0f}%"
                if r.loss_bytes_at_peak:
                    peak += (
                        f" (loss {format_bytes(r.loss_bytes_at_peak)} = "
                        f"{r.loss_bytes_at_peak / r.peak_bytes * 100:.0f}% of it)"
                    )
            heaviest = p is not None and p.max > p.min and r.rank == p.max_rank
            mark = "  <- heaviest" if heaviest else ""
            lines.append(
                f"  rank {r.rank}: {peak} of budget {format_bytes(r.budget_bytes)}, plan "
                f"bound {format_bytes(r.predicted_peak_bytes)}{mark}"
            )
            for st in r.stages:
                if not st.decisions:
                    lines.append(f"    {st.name}: not planned yet")
                    continue
                plan = ", ".join(f"{b} {d}" for b, d in st.decisions)
                lines.append(f"    {st.name}, {st.in_flight} in flight: {plan}")
            why = _unused_budget_line(r)
            if why:
                lines.append(why)
        return "\n".join(lines)


def _unused_budget_line(r: RankBudget) -> str | None:
    """Why a plan that recomputes every block leaves budget unused: the planner
    keeps whatever lowers recompute time and fits, so nothing more fits."""
    decisions = [d for st in r.stages for _, d in st.decisions]
    bound = r.predicted_peak_bytes
    if not decisions or bound is None or any(d != "full" for d in decisions):
        return None
    unused = r.budget_bytes - bound
    if unused <= 0:
        return None
    return (
        f"    every block recomputed in full with {format_bytes(unused)} of the budget "
        "unused: keeping any region of any block would take the predicted peak "
        "past the budget"
    )


@dataclass(frozen=True)
class CrossRankReport:
    """Saved-for-backward bytes across ranks, what
    :func:`~remat_dist.gather_saved_tensors_report` returns on its ``dst`` rank.

    ``format()`` gives a few lines that compare the ranks (the heaviest rank is
    marked where the ranks differ); ``to_dict()`` is JSON-ready and
    ``from_dict(d)`` reads it back.

    Attributes:
        world_size: number of ranks gathered.
        ranks: per-rank totals, sorted by rank.
        regions: per-region bytes on each rank, in forward order.
        totals: statistics of the per-rank ``total_bytes``.
        budget: the memory budgets across ranks, when a rank has one (None
            otherwise).

    Example::

        >>> report = remat_dist.gather_saved_tensors_report(loss)
        >>> if report is not None:
        ...     print(report.format())
        ...     json.dump(report.to_dict(), open("report.json", "w"))
    """

    world_size: int
    ranks: tuple[RankTotals, ...]
    regions: tuple[RegionStats, ...]
    totals: Stats
    budget: BudgetReport | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable; the keys are stable (added to, never renamed);
        ``"budget"`` is there only when a rank has a memory budget."""
        out = {
            "world_size": self.world_size,
            "ranks": [r.to_dict() for r in self.ranks],
            "regions": [r.to_dict() for r in self.regions],
            "totals": self.totals.to_dict(),
        }
        if self.budget is not None:
            out["budget"] = self.budget.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CrossRankReport:
        """Inverse of :meth:`to_dict` (unknown keys are ignored)."""
        ranks = tuple(
            RankTotals(
                rank=int(r["rank"]),
                total_bytes=int(r["total_bytes"]),
                outside_regions_bytes=int(r["outside_regions_bytes"]),
                checkpoint_input_bytes=int(r["checkpoint_input_bytes"]),
            )
            for r in d["ranks"]
        )
        regions = tuple(
            RegionStats(
                name=str(r["name"]),
                bytes=tuple(int(b) for b in r["bytes"]),
                stats=_stats_from(r),
                input_bytes=tuple(int(b) for b in r.get("input_bytes", ())),
            )
            for r in d["regions"]
        )
        budget = d.get("budget")
        return cls(
            int(d["world_size"]), ranks, regions, _stats_from(d["totals"]),
            None if budget is None else BudgetReport.from_dict(budget),
        )

    # -- text ------------------------------------------------------------------------
    def format(self) -> str:
        """A few lines that say, at a glance, how the ranks compare.

        Ranks with the same numbers are collapsed (``ranks 0-3,5``); the heaviest
        rank is marked where the ranks differ; regions with the same bytes on every rank are grouped
        (``x4 layers.0-3``).
        """
        t = self.totals
        lines = [
            f"saved for backward across {self.world_size} ranks: max "
            f"{format_bytes(t.max)} on rank {t.max_rank}, median {format_bytes(t.median)}, "
            f"min {format_bytes(t.min)}, imbalance {t.imbalance:.2f} (max/mean)",
            "",
            "per rank: total = regions + checkpoint inputs + outside regions",
        ]
        lines += self._rank_lines()
        if self.regions:
            lines += ["", "per region: bytes on each rank"]
            lines += self._region_lines()
        if self.budget is not None:
            lines += ["", self.budget.format()]
        return "\n".join(lines)

    def _rank_lines(self) -> list[str]:
        groups: dict[tuple[int, int, int], list[RankTotals]] = {}
        for r in self.ranks:
            key = (r.total_bytes, r.checkpoint_input_bytes, r.outside_regions_bytes)
            groups.setdefault(key, []).append(r)
        # "heaviest" only where the ranks differ
        heaviest = self.totals.max_rank if len(groups) > 1 else None
        ordered = list(groups.values())
        hidden: list[list[RankTotals]] = []
        if len(ordered) > MAX_RANK_LINES:
            by_weight = sorted(ordered, key=lambda g: -g[0].total_bytes)
            hidden = by_weight[MAX_RANK_LINES - 2 : -1]
            ordered = by_weight[: MAX_RANK_LINES - 2] + [by_weight[-1]]
        rows = []
        for g in ordered:
            r = g[0]
            ranks = [m.rank for m in g]
            who = _who(ranks) + ":"
            mark = "<- heaviest" if heaviest in ranks else ""
            rows.append(
                [
                    who,
                    format_bytes(r.total_bytes),
                    f"= {format_bytes(r.regions_bytes)} + {format_bytes(r.checkpoint_input_bytes)}"
                    f" + {format_bytes(r.outside_regions_bytes)}",
                    mark,
                ]
            )
        lines = table(rows, indent="  ", right=(1,))
        if hidden:
            n = sum(len(g) for g in hidden)
            low = min(g[0].total_bytes for g in hidden)
            high = max(g[0].total_bytes for g in hidden)
            lines.insert(
                len(lines) - 1,
                f"  ... {n} more rank(s) in {len(hidden)} group(s), "
                f"{format_bytes(low)} to {format_bytes(high)}",
            )
        return lines

    def _region_lines(self) -> list[str]:
        groups: dict[tuple[Any, ...], list[RegionStats]] = {}
        for region in self.regions:
            groups.setdefault((region.bytes, region.input_bytes), []).append(region)
        rank_ids = [r.rank for r in self.ranks]
        shown = list(groups.values())
        hidden = 0
        if len(shown) > MAX_REGION_LINES:
            keep = sorted(shown, key=lambda m: -m[0].stats.max)[: MAX_REGION_LINES - 1]
            hidden = sum(len(m) for m in shown if not any(m is k for k in keep))
            shown = [m for m in shown if any(m is k for k in keep)]
        rows = []
        for members in shown:
            s = members[0].stats
            names = compress_names([m.name for m in members])
            label = f"x{len(members)} {names}" if len(members) > 1 else names
            if s.min == s.max:
                spread = f"{format_bytes(s.max)} on every rank"
                detail = ""
            else:
                spread = (
                    f"min {format_bytes(s.min)}, median {format_bytes(s.median)}, max "
                    f"{format_bytes(s.max)} (rank {s.max_rank}), imbalance {s.imbalance:.2f}"
                )
                detail = _value_ranges(members[0].bytes, rank_ids)
            inputs = members[0].input_bytes
            if any(inputs):
                lo, hi = min(inputs), max(inputs)
                each = format_bytes(lo) if lo == hi else f"{format_bytes(lo)}-{format_bytes(hi)}"
                spread += f", + inputs {each}"
            if len(members) > 1:
                label += " (each)"
            rows.append([label, spread, detail])
        lines = table(rows, indent="  ")
        if hidden:
            lines.append(f"  ... {hidden} lighter region(s)")
        return lines


def _who(ranks: Sequence[int], width: int = 40) -> str:
    """``rank 3`` / ``ranks 0-3,5``; a list too long for a glance is cut and
    counted (``ranks 0-2,4-5,...(43 ranks)``)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    text = compress_ints(ranks)
    if len(text) > width:
        cut = text.rfind(",", 0, width)
        text = f"{text[: cut if cut > 0 else width]},...({len(ranks)} ranks)"
    return f"ranks {text}"


def _value_ranges(values: Sequence[int], ranks: Sequence[int], limit: int = 4) -> str:
    by_value: dict[int, list[int]] = {}
    for v, r in zip(values, ranks, strict=True):
        by_value.setdefault(v, []).append(r)
    if len(by_value) > limit:
        return ""
    parts = []
    for v, rs in sorted(by_value.items(), key=lambda kv: kv[1][0]):
        parts.append(f"{_who(rs)}: {format_bytes(v)}")
    return "(" + "; ".join(parts) + ")"


def _stats_from(d: Mapping[str, Any]) -> Stats:
    return Stats(
        min=_number(d["min"]),
        median=_number(d["median"]),
        max=_number(d["max"]),
        max_rank=int(d["max_rank"]),
        imbalance=float(d["imbalance"]),
    )


def aggregate_summaries(summaries: Sequence[Mapping[str, Any]]) -> CrossRankReport:
    """Build the cross-rank report from per-rank summaries (a pure function).

    Each summary is a :func:`saved_tensors_summary` dict plus ``"rank"`` (missing:
    its position). Regions are matched by name; a region a rank does not have
    counts 0 there. Region order: first appearance, scanning ranks in order. A
    summary's ``"budget"`` section (:func:`add_rank_section`) makes the report's
    :class:`BudgetReport`; a rank without one is left out of it.
    """
    items = sorted(
        ((int(s.get("rank", i)), s) for i, s in enumerate(summaries)),
        key=lambda x: x[0],
    )
    ranks = tuple(
        RankTotals(
            rank=r,
            total_bytes=int(s["total_bytes"]),
            outside_regions_bytes=int(s.get("outside_regions_bytes", 0)),
            checkpoint_input_bytes=int(s.get("checkpoint_input_bytes", 0)),
        )
        for r, s in items
    )
    rank_ids = [r.rank for r in ranks]
    names: list[str] = []
    per_rank: list[dict[str, int]] = []
    inputs_per_rank: list[dict[str, int]] = []
    for _, s in items:
        mine: dict[str, int] = {}
        inputs: dict[str, int] = {}
        for region in s.get("regions", ()):
            name = str(region["name"])
            if name not in mine and name not in names:
                names.append(name)
            mine[name] = mine.get(name, 0) + int(region["bytes"])
            inputs[name] = inputs.get(name, 0) + int(region.get("input_bytes", 0))
        per_rank.append(mine)
        inputs_per_rank.append(inputs)
    regions = []
    for name in names:
        values = tuple(m.get(name, 0) for m in per_rank)
        inputs = tuple(m.get(name, 0) for m in inputs_per_rank)
        regions.append(RegionStats(name, values, Stats.of(values, rank_ids), inputs))
    totals = Stats.of([r.total_bytes for r in ranks], rank_ids)
    sections = [(r, s["budget"]) for r, s in items if s.get("budget") is not None]
    budget = BudgetReport.of(sections) if sections else None
    return CrossRankReport(len(ranks), ranks, tuple(regions), totals, budget)


def gather_saved_tensors_report(
    *roots: Any, group: Any = None, dst: int = 0
) -> CrossRankReport | None:
    """Gather every rank's saved-tensor summary to ``dst`` and aggregate it there.

    A collective: call it on every rank of ``group`` after forward, with this rank's
    roots (its loss), or after a step with none. Each rank's summary carries its
    memory budgets (the peak since its previous call, the plans). Works on gloo and
    NCCL, without numpy. Without an initialised process group it reports this
    process alone.

    Args:
        *roots: this rank's roots, as for :func:`format_saved_tensors_report`.
        group: the process group (default: the world).
        dst: the global rank that receives the report.

    Returns:
        The :class:`~remat_dist.report.CrossRankReport` on ``dst``, ``None`` on the
        other ranks.

    Example::

        >>> loss = model(tokens, targets)
        >>> report = remat_dist.gather_saved_tensors_report(loss)
        >>> loss.backward()
        >>> if dist.get_rank() == 0:
        ...     print(report.format())
    """
    import torch.distributed as dist

    from remat_dist.report._saved import saved_tensors_summary

    summary = saved_tensors_summary(*roots)
    for key, source in list(_SECTIONS.items()):
        part = source()
        if part is not None:
            summary[key] = part
    if not dist_ready():
        summary["rank"] = 0
        return aggregate_summaries([summary])
    summary["rank"] = dist.get_rank()
    gathered = all_gather_objects(summary, group)
    if dist.get_rank() != dst:
        return None
    return aggregate_summaries(gathered)
