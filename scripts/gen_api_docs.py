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
        "Regions and checkpoints",
        "torch_remat's model: recompute by default, keep what a region says.",
        [
            "checkpoint",
            "region",
            "name_scope",
            "recompute_needs_tensor",
            "save_for_backward",
            "is_recomputing",
            "is_placeholder",
            "RecomputeStateHook",
            "saved_tensors_hooks",
            "current_saved_tensor_info",
            "SavedTensorInfo",
            "SavedTensorKind",
            "gradient_checkpoint_scope",
        ],
    ),
    (
        "Models: wrapping, sharding, the memory budget",
        "Checkpoint a model's blocks in place, shard it for FSDP2 and tensor "
        "parallelism, or let a byte budget choose.",
        [
            "apply_remat",
            "remove_remat",
            "remat_plan",
            "BlockRemat",
            "shard_model",
            "reference_tp_plan",
            "TensorParallelPlan",
            "MemoryBudget",
            "current_plan",
            "BudgetPlan",
            "BlockPlan",
        ],
    ),
    (
        "Ranks: replay safety and RNG",
        "What makes a replay safe and exact on every rank (docs/distributed.md, "
        "docs/rng.md).",
        [
            "CollectiveMode",
            "set_replay_timeout",
            "mark_step",
            "check_plan_consistency",
            "step_stats",
            "StepStats",
            "default_state_hooks",
            "DeviceRNGStateHook",
            "CPURNGStateHook",
            "DTensorRNGStateHook",
            "GeneratorStateHook",
        ],
    ),
    (
        "Traces and reports",
        "What a forward ran and what backward will need, per process and across "
        "ranks (torch_remat's call shapes; docs/reports.md).",
        [
            "collect_trace",
            "trace_scope",
            "Trace",
            "saved_tensors_summary",
            "format_saved_tensors_report",
            "print_saved_tensors_report",
            "gather_saved_tensors_report",
            "CrossRankReport",
            "discover_autograd_roots",
            "format_current_memory_report",
            "print_current_memory_report",
            "attach_oom_observer",
            "oom_observer",
            "format_oom_saved_tensors_report",
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
            "ReplayMismatchError",
            "CollectiveReplayError",
            "ReplayValueMismatchError",
            "PlanMismatchError",
            "AgreementSetupError",
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
        "checks it is current). This is the whole user surface, each name once, all",
        "from the one front door: `import remat_dist as remat`. The names here are the",
        "product's promise; the mental model is in [mental_model.md](mental_model.md),",
        "the layers in [architecture.md](architecture.md), the extension interface for",
        "layers built on the core in [extending.md](extending.md).",
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
    missing = sorted(set(remat_dist.__all__) ^ listed)
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
