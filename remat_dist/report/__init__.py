"""Diagnostics: traces, memory reports, OOM reports and the cross-rank report.

Per process (torch_remat's call shapes):

* :func:`collect_trace` / :func:`trace_scope`: the region hierarchy a forward ran,
  with save/recompute per region;
* :func:`format_current_memory_report` / :func:`print_current_memory_report`:
  inside a checkpoint forward, what the running checkpoint keeps;
* :func:`format_saved_tensors_report` / :func:`print_saved_tensors_report` /
  :func:`saved_tensors_summary`: after forward, every byte backward will need,
  reachable from the roots (checkpoint inputs and DTensor local shards included);
* :func:`oom_observer` / :func:`attach_oom_observer`,
  :func:`discover_autograd_roots`, :func:`memory_snapshot_annotate`: the same
  report at a CUDA out-of-memory, with allocation sites.

Across ranks: :func:`gather_saved_tensors_report` gathers per-rank summaries into
a :class:`CrossRankReport` (:func:`aggregate_summaries` is the pure part); layers
above add per-rank sections through :func:`add_rank_section` (the memory budget's
becomes the report's :class:`BudgetReport`).

torch_remat's report functions and :func:`gather_saved_tensors_report` are
published at ``remat_dist``; ``__all__`` here lists the report objects a user
reads (:class:`Trace`, :class:`CrossRankReport`), :func:`saved_tensors_summary`,
:func:`attach_oom_observer`, and the parts that only the report's builders and the
side packages use.
"""

from remat_dist.report._accounting import Annotate
from remat_dist.report._annotate import (
    clear_memory_snapshot_cache as clear_memory_snapshot_cache,
)
from remat_dist.report._annotate import (
    memory_snapshot_annotate as memory_snapshot_annotate,
)
from remat_dist.report._cross_rank import (
    BudgetReport,
    CrossRankReport,
    RankBudget,
    RankTotals,
    RegionStats,
    StagePlan,
    Stats,
    add_rank_section,
    aggregate_summaries,
)
from remat_dist.report._cross_rank import (
    gather_saved_tensors_report as gather_saved_tensors_report,
)
from remat_dist.report._current import (
    format_current_memory_report as format_current_memory_report,
)
from remat_dist.report._current import (
    print_current_memory_report as print_current_memory_report,
)
from remat_dist.report._oom import attach_oom_observer
from remat_dist.report._oom import (
    format_oom_saved_tensors_report as format_oom_saved_tensors_report,
)
from remat_dist.report._oom import oom_observer as oom_observer
from remat_dist.report._roots import discover_autograd_roots as discover_autograd_roots
from remat_dist.report._saved import (
    SavedTensorsReport,
    build_saved_tensors_report,
    saved_tensors_summary,
)
from remat_dist.report._saved import (
    format_saved_tensors_report as format_saved_tensors_report,
)
from remat_dist.report._saved import (
    print_saved_tensors_report as print_saved_tensors_report,
)
from remat_dist.report._trace import Trace, TraceNode
from remat_dist.report._trace import collect_trace as collect_trace
from remat_dist.report._trace import trace_scope as trace_scope

# The names above imported "as" themselves are published at remat_dist.
__all__ = [
    # for users: report objects and helpers beyond torch_remat's
    "Trace",
    "CrossRankReport",
    "saved_tensors_summary",
    "attach_oom_observer",
    # for the report's builders and the side packages
    "Annotate",
    "BudgetReport",
    "RankBudget",
    "RankTotals",
    "RegionStats",
    "SavedTensorsReport",
    "StagePlan",
    "Stats",
    "TraceNode",
    "add_rank_section",
    "aggregate_summaries",
    "build_saved_tensors_report",
]
