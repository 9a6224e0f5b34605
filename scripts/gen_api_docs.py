"""Generate docs/api.md from the docstrings: `python scripts/gen_api_docs.py [--check]`.

One section per module a user imports: ``remat_dist`` itself (torch_remat's names
and the few of remat_dist's own a training script calls), then the named modules.
Signatures show defaults as code (``'replay'``, not ``replay``). ``--check`` exits 1
when docs/api.md is stale (the test suite runs it); a name without a docstring
fails the generation.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import remat_dist  # noqa: E402

TOP: list[tuple[str, str, list[str]]] = [
    (
        "Checkpoints and regions",
        "torch_remat's model: a checkpoint recomputes its function in backward; a "
        "region inside it keeps what it computes (`recompute=False`).",
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
            "CollectiveMode",
        ],
    ),
    (
        "Models",
        "Checkpoint a model's blocks in place, shard it for FSDP2 and tensor "
        "parallelism, or let a byte budget choose what each block keeps.",
        ["apply_remat", "remove_remat", "shard_model", "MemoryBudget"],
    ),
    (
        "Traces and reports",
        "What a forward ran and what backward will need, per process (torch_remat's "
        "call shapes) and across ranks.",
        [
            "collect_trace",
            "trace_scope",
            "format_saved_tensors_report",
            "print_saved_tensors_report",
            "gather_saved_tensors_report",
            "format_current_memory_report",
            "print_current_memory_report",
            "discover_autograd_roots",
            "oom_observer",
            "format_oom_saved_tensors_report",
            "memory_snapshot_annotate",
            "clear_memory_snapshot_cache",
        ],
    ),
    (
        "Errors",
        "Every error derives from `RematError` (a `RuntimeError`); the other kinds are "
        "in `remat_dist.errors`.",
        ["RematError", "RematUsageError"],
    ),
]

MODULES: list[tuple[str, str, list[str]]] = [
    (
        "remat_dist.wrap",
        "What `apply_remat` did to a model.",
        ["checkpointed_blocks", "BlockRemat"],
    ),
    (
        "remat_dist.shard",
        "Tensor-parallel plans for `shard_model`.",
        ["reference_tp_plan", "TensorParallelPlan"],
    ),
    (
        "remat_dist.budget",
        "The plan a `MemoryBudget` chose.",
        ["current_plan", "BudgetPlan", "BlockPlan"],
    ),
    (
        "remat_dist.distributed",
        "Replay across ranks and the state hooks that make dropout replay exactly "
        "([distributed.md](distributed.md), [rng.md](rng.md)).",
        [
            "default_state_hooks",
            "CPURNGStateHook",
            "DeviceRNGStateHook",
            "DTensorRNGStateHook",
            "GeneratorStateHook",
            "set_replay_timeout",
            "join_agreements",
            "check_plan_consistency",
            "step_stats",
            "StepStats",
        ],
    ),
    (
        "remat_dist.report",
        "Report objects and helpers beyond torch_remat's ([reports.md](reports.md)).",
        ["Trace", "CrossRankReport", "saved_tensors_summary", "attach_oom_observer"],
    ),
    (
        "remat_dist.errors",
        "The error kinds raised on replay and across ranks; "
        "[troubleshooting.md](troubleshooting.md) gives the cause and fix of each.",
        [
            "PlaceholderAccessError",
            "ReplayMismatchError",
            "ReplayValueMismatchError",
            "CollectiveReplayError",
            "PlanMismatchError",
            "AgreementSetupError",
        ],
    ),
    (
        "remat_dist.testing",
        "Run a test body on real gloo ranks ([testing.md](testing.md)).",
        ["distributed", "run_distributed", "DistContext"],
    ),
]

TYPE_ALIASES = {
    "CollectiveMode": (
        'CollectiveMode = Literal["replay", "save"]',
        "What a checkpoint does with the collectives its forward issued, given as "
        "`collectives=` to `checkpoint`, `region` and `apply_remat`:\n\n"
        '* `"replay"` (the default under a process group): the replay issues each '
        "collective again, checked against what the forward issued before it runs;\n"
        '* `"save"`: the collectives\' outputs are kept, and the replay issues no '
        "communication (more memory, no second all-gather or reduce).",
    ),
}


class _Code(str):
    """An annotation written as text (``from __future__ import annotations``),
    shown as written rather than quoted."""

    def __repr__(self) -> str:
        return str(self)


def _signature(obj: object) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""

    def plain(annotation: object) -> object:
        return _Code(annotation) if isinstance(annotation, str) else annotation

    params = [p.replace(annotation=plain(p.annotation)) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=plain(sig.return_annotation)))


def _entry(title: str, name: str, obj: object) -> list[str]:
    if name in TYPE_ALIASES:
        head, doc = TYPE_ALIASES[name]
        return [f"### `{title}`", "", f"```text\n{head}\n```", "", doc, ""]
    kind = "class" if inspect.isclass(obj) else "function"
    is_error = inspect.isclass(obj) and issubclass(obj, BaseException)
    sig = "" if is_error else _signature(obj)
    doc = inspect.getdoc(obj)
    if not doc:
        raise SystemExit(f"gen_api_docs: {title} has no docstring")
    return [f"### `{title}`", "", f"```text\n{kind} {name}{sig}\n```", "", doc, ""]


def render() -> str:
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `scripts/gen_api_docs.py` (the test suite",
        "checks it is current). `import remat_dist as remat` gives torch_remat's names",
        "and the few of remat_dist's own that a training script calls; the rest is in",
        "the named modules below. Words of remat_dist's own are defined in",
        "[glossary.md](glossary.md).",
        "",
        "## `remat_dist`",
        "",
    ]
    listed = set()
    for title, blurb, names in TOP:
        lines += [f"### {title}", "", blurb, ""]
        for name in names:
            listed.add(name)
            lines += ["#" + line if line.startswith("### ") else line
                      for line in _entry(name, name, getattr(remat_dist, name))]
    missing = sorted(set(remat_dist.__all__) ^ listed)
    if missing:
        raise SystemExit(f"gen_api_docs: public names without a section: {missing}")
    for module_name, blurb, names in MODULES:
        module = importlib.import_module(module_name)
        lines += [f"## `{module_name}`", "", blurb, ""]
        for name in names:
            lines += _entry(f"{module_name}.{name}", name, getattr(module, name))
    lines += [
        "## Deprecated top-level names",
        "",
        "These names left the top level in 0.1.0. The old spelling still works until",
        "0.2.0 and raises a `DeprecationWarning` naming the new one.",
        "",
        "| old | new |",
        "|---|---|",
    ]
    for name, target in remat_dist.MOVED.items():
        lines.append(f"| `remat_dist.{name}` | `{target}` |")
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
