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
a :class:`CrossRankReport` (:func:`aggregate_summaries` is the pure part).
"""

from remat_dist.report._accounting import Annotate
from remat_dist.report._annotate import (
    clear_memory_snapshot_cache,
    memory_snapshot_annotate,
)
from remat_dist.report._cross_rank import (
    CrossRankReport,
    RankTotals,
    RegionStats,
    Stats,
    aggregate_summaries,
    gather_saved_tensors_report,
)
from remat_dist.report._current import (
    format_current_memory_report,
    print_current_memory_report,
)
from remat_dist.report._oom import (
    attach_oom_observer,
    format_oom_saved_tensors_report,
    oom_observer,
)
from remat_dist.report._roots import discover_autograd_roots
from remat_dist.report._saved import (
    SavedTensorsReport,
    build_saved_tensors_report,
    format_saved_tensors_report,
    print_saved_tensors_report,
    saved_tensors_summary,
)
from remat_dist.report._trace import Trace, TraceNode, collect_trace, trace_scope

__all__ = [
    "Annotate",
    "CrossRankReport",
    "RankTotals",
    "RegionStats",
    "SavedTensorsReport",
    "Stats",
    "Trace",
    "TraceNode",
    "aggregate_summaries",
    "attach_oom_observer",
    "build_saved_tensors_report",
    "clear_memory_snapshot_cache",
    "collect_trace",
    "discover_autograd_roots",
    "format_current_memory_report",
    "format_oom_saved_tensors_report",
    "format_saved_tensors_report",
    "gather_saved_tensors_report",
    "memory_snapshot_annotate",
    "oom_observer",
    "print_current_memory_report",
    "print_saved_tensors_report",
    "saved_tensors_summary",
    "trace_scope",
]
