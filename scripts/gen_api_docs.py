"""Generate docs/api.md from the docstrings: `python scripts/gen_api_docs.py [--check]`.

One section per layer, one entry per public name (signature and docstring), in the
order of the API contract. ``--check`` exits 1 when docs/api.md is stale (the test
suite runs it).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import remat_dist  # noqa: E402

SECTIONS: list[tuple[str, str, list[str]]] = [
    (
        "Core runtime",
        "remat_dist.core: single process, knows nothing of ranks.",
        [
            "checkpoint",
            "region",
            "recompute_needs_tensor",
            "name_scope",
            "is_recomputing",
            "is_placeholder",
            "save_for_backward",
            "saved_tensors_hooks",
            "current_saved_tensor_info",
            "SavedTensorInfo",
            "SavedTensorKind",
            "RecomputeStateHook",
            "gradient_checkpoint_scope",
        ],
    ),
    (
        "Distributed",
        "remat_dist.distributed: attached to the core through its seams.",
        [
            "DeviceRNGStateHook",
            "CPURNGStateHook",
            "GeneratorStateHook",
            "DTensorRNGStateHook",
            "default_state_hooks",
            "check_plan_consistency",
            "mark_step",
            "set_replay_timeout",
            "gather_saved_tensors_report",
            "CrossRankReport",
        ],
    ),
    (
        "Wrapping utilities",
        "remat_dist.fsdp: FSDP2 / tensor parallelism in the right order.",
        [
            "apply_remat",
            "remove_remat",
            "remat_plan",
            "MemoryBudget",
            "current_plan",
            "shard_model",
            "reference_tp_plan",
            "TensorParallelPlan",
        ],
    ),
    (
        "Diagnostics",
        "remat_dist.report: traces and memory reports (torch_remat's call shapes).",
        [
            "collect_trace",
            "trace_scope",
            "format_current_memory_report",
            "print_current_memory_report",
            "format_saved_tensors_report",
            "print_saved_tensors_report",
            "saved_tensors_summary",
            "oom_observer",
            "attach_oom_observer",
            "format_oom_saved_tensors_report",
            "discover_autograd_roots",
            "memory_snapshot_annotate",
            "clear_memory_snapshot_cache",
        ],
    ),
    (
        "Errors",
        "All derive from RematError(RuntimeError).",
        [
            "RematError",
            "RematUsageError",
            "PlaceholderAccessError",
            "CollectiveReplayError",
            "PlanMismatchError",
            "ReplayMismatchError",
        ],
    ),
]


def _signature(obj: object) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    return sig.replace("'", "")


def render() -> str:
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `scripts/gen_api_docs.py` (the test suite",
        "checks it is current). Everything is importable from the top level:",
        "`import remat_dist as remat`. The names here are the product's promise (the",
        "sections follow the API contract); the mental model is in",
        "[mental_model.md](mental_model.md), the layers in [architecture.md](architecture.md).",
        "",
    ]
    listed = set()
    for title, blurb, names in SECTIONS:
        lines += [f"## {title}", "", blurb, ""]
        for name in names:
            obj = getattr(remat_dist, name)
            listed.add(name)
            kind = "class" if inspect.isclass(obj) else "function"
            sig = _signature(obj) if kind == "function" or not issubclass(obj, BaseException) else ""
            lines += [f"### `{name}`", "", f"```text\n{kind} {name}{sig}\n```", ""]
            doc = inspect.getdoc(obj) or "(no docstring)"
            lines += [doc, ""]
    missing = sorted(set(remat_dist.__all__) - listed)
    if missing:
        raise SystemExit(f"gen_api_docs: public names without a section: {missing}")
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    path = ROOT / "docs" / "api.md"
    text = render()
    if "--check" in sys.argv:
        if not path.exists() or path.read_text() != text:
            print("docs/api.md is stale: run python scripts/gen_api_docs.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
