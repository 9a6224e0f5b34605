"""Generate docs/api.md from the docstrings: `python scripts/gen_api_docs.py [--check]`.

One section per module a user imports: ``remat_dist`` itself (torch_remat's names
and the few of remat_dist's own a training script calls), then the named modules.
Signatures are rendered here, the same text under every Python: defaults as
code (``'replay'``, not ``replay``; an enum member as ``Kind.NAME``). ``--check`` exits 1
when docs/api.md is stale (the test suite runs it); a name without a docstring
fails the generation.
"""

from __future__ import annotations

import enum
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


_FACTORY = "<factory>"
"""How a dataclass field's ``default_factory`` shows (as ``dataclasses`` writes it)."""


def _default(value: object, where: str) -> str:
    """A default as code, the same text under every Python (``repr`` of an enum
    member or of a sentinel is not): literals as Python writes them, an enum
    member as ``Kind.NAME``, tuples and lists of those."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        items = [_default(v, where) for v in value]
        if isinstance(value, list):
            return "[" + ", ".join(items) + "]"
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if repr(value) == _FACTORY:
        return _FACTORY
    raise SystemExit(
        f"gen_api_docs: {where} has a default of type {type(value).__name__}, which "
        "has no stable spelling: teach _default to write it"
    )


def _annotation(annotation: object, where: str) -> str:
    """An annotation as written in the source (every module here uses ``from
    __future__ import annotations``, so they are strings)."""
    if isinstance(annotation, str):
        return annotation
    if annotation is None:  # what dataclasses give a generated __init__
        return "None"
    if isinstance(annotation, type):
        return annotation.__name__
    raise SystemExit(
        f"gen_api_docs: {where} has an annotation that is not text ({annotation!r}): "
        "add `from __future__ import annotations` to its module"
    )


def _signature(obj: object, where: str) -> str:
    """``(params) -> return`` rendered here rather than by ``str(Signature)``,
    whose spelling of defaults changes between Python versions. Enum and protocol
    classes show their bases instead: their call signatures are the machinery's."""
    if inspect.isclass(obj):
        if issubclass(obj, enum.Enum):
            return "(enum.Enum)"
        if getattr(obj, "_is_protocol", False):
            return "(typing.Protocol)"
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    parts: list[str] = []
    kinds = [p.kind for p in sig.parameters.values()]
    star_done = inspect.Parameter.VAR_POSITIONAL in kinds
    for i, p in enumerate(sig.parameters.values()):
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        text = p.name
        if p.kind is p.VAR_POSITIONAL:
            text = "*" + text
        elif p.kind is p.VAR_KEYWORD:
            text = "**" + text
        if p.annotation is not p.empty:
            text += ": " + _annotation(p.annotation, f"{where}({p.name})")
        if p.default is not p.empty:
            eq = " = " if p.annotation is not p.empty else "="
            text += eq + _default(p.default, f"{where}({p.name})")
        parts.append(text)
        following = kinds[i + 1] if i + 1 < len(kinds) else None
        if p.kind is p.POSITIONAL_ONLY and following is not p.POSITIONAL_ONLY:
            parts.append("/")
    out = "(" + ", ".join(parts) + ")"
    if sig.return_annotation is not sig.empty:
        out += " -> " + _annotation(sig.return_annotation, f"{where} return")
    return out


def _entry(title: str, name: str, obj: object) -> list[str]:
    if name in TYPE_ALIASES:
        head, doc = TYPE_ALIASES[name]
        return [f"### `{title}`", "", f"```text\n{head}\n```", "", doc, ""]
    kind = "class" if inspect.isclass(obj) else "function"
    is_error = inspect.isclass(obj) and issubclass(obj, BaseException)
    sig = "" if is_error else _signature(obj, title)
    doc = inspect.getdoc(obj)
    if not doc:
        raise SystemExit(f"gen_api_docs: {title} has no docstring")
    return [f"### `{title}`", "", f"```text\n{kind} {name}{sig}\n```", "", doc, ""]


RENAMED = [
    ("remat_dist.wrap.remat_plan", "remat_dist.wrap.checkpointed_blocks"),
    ("remat_dist.distributed.mark_step", "remat_dist.distributed.join_agreements"),
]
"""Names of the named modules that have a new name (old, new), each kept as a
deprecated alias for one release."""


def _check_renamed(old: str, new: str) -> None:
    """The old name still gives the new one, with a warning that names it."""
    import warnings

    module_name, old_name = old.rsplit(".", 1)
    new_module, new_name = new.rsplit(".", 1)
    module = importlib.import_module(module_name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = getattr(module, old_name)
    named = any(
        issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught
    )
    if got is not getattr(importlib.import_module(new_module), new_name) or not named:
        raise SystemExit(f"gen_api_docs: {old} is not a deprecated alias naming {new}")


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
    lines += [
        "",
        "## Deprecated names in the named modules",
        "",
        "The old spelling of a renamed name works until 0.2.0 and raises a",
        "`DeprecationWarning` naming the new one.",
        "",
        "| old | new |",
        "|---|---|",
    ]
    for old, new in RENAMED:
        _check_renamed(old, new)
        lines.append(f"| `{old}` | `{new}` |")
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
