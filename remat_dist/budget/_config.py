"""What the memory-budget planner chooses: the :class:`BudgetPlan` of a model and
its :class:`BlockPlan` s (see ``remat_dist.budget._planner`` for how, and
``docs/memory_budget.md``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from remat_dist.budget._profile import human

__all__ = ["BlockPlan", "BudgetPlan"]


@dataclass(frozen=True)
class BlockPlan:
    """The planner's decision for one block (see :func:`current_plan`).

    Attributes:
        name: the block's qualified name.
        decision: ``"full"``, ``"none"`` (no checkpoint), ``"save a+b"`` (the
            checkpoint keeps submodules ``a`` and ``b`` as save regions) or,
            compiled with inductor, ``"min-cut 0.5"`` (no checkpoint; the block
            compiled with torch's min-cut partitioner at that
            ``activation_memory_budget``, which chooses the ops it recomputes).
        regions: the policy dict it stands for (``{}`` for full, None for none).
        bytes: saved bytes of this decision, maximum over ranks.
        time_s: recompute time of this decision in backward, maximum over ranks.
        candidates: ``{decision: (bytes, time_s)}`` of every candidate measured.
        memory_budget: the ``activation_memory_budget`` the block is compiled
            at (a ``"min-cut"`` decision), else None.
        cheaper: why the plan did not take an option of less recompute for this
            block: ``(decision, seconds of recompute it would save, bytes it
            would add to the rank's peak)`` for the one of those options that
            needs fewest bytes (more than the budget has left, or the plan
            would have taken it); None when the block recomputes nothing.
    """

    name: str
    decision: str
    regions: dict[str, str] | None
    bytes: int
    time_s: float
    candidates: dict[str, tuple[int, float]] = field(default_factory=dict, repr=False)
    cheaper: tuple[str, float, int] | None = field(default=None, repr=False)
    memory_budget: float | None = None


@dataclass
class BudgetPlan:
    """What the planner chose for a model, and from which numbers.

    Attributes:
        budget: the budget in bytes.
        blocks: per block, in model order.
        outside_bytes: bytes saved outside the blocks (embeddings, final norm, head),
            maximum over ranks.
        predicted_bytes: ``outside_bytes`` plus ``loss_bytes`` plus the blocks'
            bytes: what the rank that needs most should save per forward.
        predicted_time_s: the blocks' recompute times summed (the objective).
        world_size: ranks the measurements came from (1 without a process group).
        measured_bytes: this rank's saved bytes in the first forward under the
            plan (None until it ran).
        in_flight: the most forwards whose graphs were alive at once in the
            profiling step, on the rank with most (1 without pipelining or
            interleaved micro-batches; under a pipeline schedule, what the
            schedule kept alive on this stage).
        predicted_peak_bytes: ``in_flight * predicted_bytes``: the peak the plan
            should keep on the rank that needs most, at or under ``budget``.
        ranks: the global ranks whose measurements were taken (this model's
            tensor-parallel / FSDP2 ranks; ``(0,)`` without a process group).
        shared_by: how many models on this rank share the ``MemoryBudget``
            object (and plan together); 1 for a budget of its own.
        rank_peak_bytes: the rank's peak the plan predicts, at or under
            ``budget``: with a budget of its own ``predicted_peak_bytes``;
            shared, the most bytes alive at any moment the profiling step
            showed (``concurrent``), each model's forwards at its planned
            bytes per forward.
        loss_bytes: bytes saved after one forward returned, before the next
            forward of a model under a budget (the loss), maximum over ranks;
            part of ``predicted_bytes``.
        sum_bound_bytes: the sum over the models sharing the budget of their
            ``predicted_peak_bytes``, every model at its own peak at once (an
            upper bound of ``rank_peak_bytes``).
        concurrent: the forwards alive at once per model sharing the budget
            (in ``apply_remat`` order) at the moments that can hold the
            rank's peak; ``((in_flight,),)`` for a budget of its own.
    """

    budget: int
    blocks: list[BlockPlan]
    outside_bytes: int
    predicted_bytes: int
    predicted_time_s: float
    world_size: int = 1
    measured_bytes: int | None = None
    in_flight: int = 1
    predicted_peak_bytes: int = 0
    ranks: tuple[int, ...] = (0,)
    shared_by: int = 1
    rank_peak_bytes: int = 0
    loss_bytes: int = 0
    sum_bound_bytes: int = 0
    concurrent: tuple[tuple[int, ...], ...] = ()

    def decisions(self) -> dict[str, str]:
        """``{block name: decision}``."""
        return {b.name: b.decision for b in self.blocks}

    @property
    def left_bytes(self) -> int:
        """The budget the plan leaves unused at the rank's predicted peak."""
        return self.budget - (self.rank_peak_bytes or self.predicted_peak_bytes
                              or self.predicted_bytes)

    def format(self) -> str:
        """A few lines for logs: budget, totals, one line per block; where a
        block recomputes, why an option of less recompute was not taken (it
        needs more bytes than the budget has left)."""
        head = (
            f"budget {human(self.budget)}: predicted peak "
            f"{human(self.predicted_peak_bytes or self.predicted_bytes)} per rank = "
            f"{self.in_flight} forward(s) alive x {human(self.predicted_bytes)} saved "
            f"(outside blocks {human(self.outside_bytes)}, after the forward (the loss) "
            f"{human(self.loss_bytes)}), recompute "
            f"{self.predicted_time_s * 1e3:.2f} ms per forward, over "
            f"{self.world_size} rank(s) {list(self.ranks)}"
        )
        if self.shared_by > 1:
            head += (
                f"; the budget is shared by {self.shared_by} models on this rank, "
                f"predicted rank peak {human(self.rank_peak_bytes)} (their own peaks "
                f"summed: {human(self.sum_bound_bytes)})"
            )
        head += f"; {human(self.left_bytes)} of the budget left"
        rows = []
        for b in self.blocks:
            row = f"  {b.name}: {b.decision:<18} {human(b.bytes):>10} {b.time_s * 1e3:8.3f} ms"
            if b.cheaper is not None:
                label, saved_s, more = b.cheaper
                row += (
                    f"  ({label!r} instead would save {saved_s * 1e3:.3f} ms of "
                    f"recompute but need {human(more)} more than the "
                    f"{human(self.left_bytes)} left)"
                )
            rows.append(row)
        return "\n".join([head, *rows])
