"""The memory-budget planner: ``MemoryBudget`` (a ``policy=`` of ``apply_remat``),
the ``BudgetPlan`` it chooses and ``current_plan`` (published at ``remat_dist``).

It plugs into the wrapping layer through ``remat_dist.wrap.PlannedPolicy``: the
planner profiles the blocks in the first step, plans, and installs the plan, every
change through the ``BlockInstaller`` ``apply_remat`` gave it. See
``docs/memory_budget.md``.
"""

from remat_dist.budget._budget import (
    MemoryBudget as MemoryBudget,  # published at remat_dist
)
from remat_dist.budget._config import BlockPlan as BlockPlan  # published at remat_dist
from remat_dist.budget._config import (
    BudgetPlan as BudgetPlan,  # published at remat_dist
)
from remat_dist.budget._planner import BudgetPhase
from remat_dist.budget._planner import (
    current_plan as current_plan,  # published at remat_dist
)
from remat_dist.budget._profile import DEFAULT_REGION_NAMES, parse_bytes
from remat_dist.budget._summary import rank_summary

__all__ = ["DEFAULT_REGION_NAMES", "BudgetPhase", "parse_bytes", "rank_summary"]
