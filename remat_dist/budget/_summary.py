"""This rank's memory budgets as plain data, for the cross-rank report.

The report layer may not import the budget layer (``tests/test_layers.py``); the
composition root (``remat_dist/__init__.py``) hands :func:`rank_summary` to the
report's rank-section seam (``remat_dist.report.add_rank_section``), and every
``gather_saved_tensors_report`` adds what it returns to this rank's summary under
``"budget"``. The report knows the shape of that dict (below), not this module.

Shape (JSON-able)::

    {"budgets": [{
        "budget": int,                  # bytes
        "peak_bytes": int | None,       # measured since the previous report
                                        # (None: not asked, measure_peak=False,
                                        # or no plan yet)
        "loss_bytes_at_peak": int | None,  # of peak_bytes, what was saved after
                                        # a forward (the loss) at that moment
        "predicted_peak_bytes": int,    # what the joint plan bounds (0: no plan yet)
        "models": [{"name": str, "blocks": [str], "in_flight": int | None,
                    "decisions": [[block, decision]] | None,
                    "predicted_peak_bytes": int | None, "loss_bytes": int | None,
                    "phase": str}],
    }]}

Models dropped by the caller but kept by reference cycles (a pipeline stage and
its schedule) would still count: when a budget is in use, a garbage collection
runs first (a diagnostic's cost, once per report; nothing without a budget).

Reading it opens the next window of each budget's step meter (the peak starts
again from what is alive now), so gathered after every step the report shows
each step's peak.
"""

from __future__ import annotations

import gc
from typing import Any

from remat_dist.budget._planner import BudgetPhase, live_budgets, stage_name

__all__ = ["rank_summary"]


def rank_summary() -> dict[str, Any] | None:
    """Every budget in use on this rank (None: none), see the module doc; a
    model whose planner failed is left out (it raises at every forward)."""
    if not live_budgets():
        return None
    gc.collect()  # models in dropped reference cycles leave their budgets
    budgets = []
    for shared in live_budgets():
        members = [m for m in shared.members if m.phase is not BudgetPhase.FAILED]
        if not members:
            continue  # a failed planner raises at every forward: not a budget in use
        models = []
        predicted = 0
        for state in members:
            plan = state.plan if state.phase in (BudgetPhase.VERIFY, BudgetPhase.PLANNED) else None
            models.append({
                "name": stage_name(state),
                "blocks": [name for name, _ in state.installer.blocks],
                "in_flight": None if plan is None else plan.in_flight,
                "decisions": None if plan is None else [list(d) for d in plan.decisions().items()],
                "predicted_peak_bytes": None if plan is None else plan.predicted_peak_bytes,
                "loss_bytes": None if plan is None else plan.loss_bytes,
                "phase": state.phase.value,
            })
            if plan is not None:
                predicted = plan.rank_peak_bytes or plan.predicted_peak_bytes
        meter = shared.meter
        peak = loss_at_peak = None
        if meter is not None:
            peak, loss_at_peak = meter.peak, meter.after_at_peak
            meter.restart()
        budgets.append({
            "budget": shared.budget.bytes,
            "peak_bytes": peak,
            "loss_bytes_at_peak": loss_at_peak,
            "predicted_peak_bytes": predicted,
            "models": models,
        })
    return {"budgets": budgets} if budgets else None  # none in use
