"""Tensor-parallel plans for ``shard_model``: :class:`TensorParallelPlan`,
:func:`reference_tp_plan`, and the checks that refuse a plan ``shard_model`` could
not keep correct.

Apart from ``remat_dist.shard._shard`` (which applies plans to a model) because a
plan is data a user builds and ``shard_model`` validates before touching the
model: which styles shard the sequence, whether the plan says what layout its
blocks take and return (see "Block boundaries under sequence parallelism" in
``remat_dist.shard._shard``), and that every entry is a torch ``ParallelStyle``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from remat_dist._errors import RematUsageError
from remat_dist._torch import _dtensor

__all__ = [
    "REPLICATE",
    "SEQUENCE",
    "TPPlanLike",
    "TensorParallelPlan",
    "normalize_plan",
    "reference_tp_plan",
]

REPLICATE = "replicate"
SEQUENCE = "sequence"
_LAYOUTS = (REPLICATE, SEQUENCE)


@dataclass(frozen=True)
class TensorParallelPlan:
    """A tensor-parallel plan that ``shard_model`` can apply and keep correct.

    Attributes:
        block: ``parallelize_module`` plan applied to every block, keys relative to
            the block (``"attention.wq"``; ``fnmatch`` wildcards per path token, as
            ``parallelize_module`` allows; ``""`` is the block itself). Every key
            must name a submodule of each block (``parallelize_module`` would only
            warn and skip it).
        root: plan applied once to the model for modules outside the blocks
            (embeddings, final norm, head), keys relative to the model. It must not
            reach into blocks, nor shard the sequence (blocks hand it full tensors).
        block_input: what layout the block plan expects its first positional
            input in: ``"replicate"`` (the full tensor, e.g. column-wise first
            layers) or ``"sequence"`` (this rank's shard along ``sequence_dim``;
            ``shard_model`` then slices the full block input). None: infer
            ``"replicate"`` for a plan without sequence layouts, refuse otherwise.
        block_output: what layout the block's output comes out in:
            ``"replicate"`` or ``"sequence"`` (``shard_model`` then all-gathers it
            back to the full tensor). None: as ``block_input``.
        sequence_dim: the sequence dimension of block inputs and outputs.
    """

    block: Mapping[str, Any]
    root: Mapping[str, Any] = field(default_factory=dict)
    block_input: str | None = None
    block_output: str | None = None
    sequence_dim: int = 1


TPPlanLike = Union[TensorParallelPlan, Mapping[str, Any]]
"""What ``shard_model(tp_plan=...)`` accepts: a plan, or a mapping (the per-block
plan, i.e. ``TensorParallelPlan(block=mapping)``)."""


def reference_tp_plan(sequence_parallel: bool = False) -> TensorParallelPlan:
    """The tensor-parallel plan of ``remat_dist.models.GPT`` blocks.

    Column-wise ``attention.wq/wk/wv`` and ``mlp.w1``, row-wise ``attention.wo``
    and ``mlp.w2`` (needs ``n_heads`` divisible by the TP degree). Embeddings, the
    final norm and the head stay replicated. For a model of your own, pass a dict of
    torch's ``ParallelStyle`` per block submodule to ``shard_model`` instead
    (``examples/model.py``), or a :class:`TensorParallelPlan`.

    Args:
        sequence_parallel: the norms run on this rank's sequence shard
            (``SequenceParallel``), attention and MLP inputs are all-gathered along
            the sequence and the row-wise outputs reduce-scattered back, so the
            residual stream inside a block is sequence-sharded; ``shard_model``
            slices each block's (full) input and gathers its output (needs the
            sequence length divisible by the TP degree).

    Returns:
        A :class:`TensorParallelPlan`.

    Example::

        >>> from remat_dist.shard import reference_tp_plan
        >>> remat_dist.shard_model(model, mesh, blocks=Block, tp_plan=reference_tp_plan())
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence_parallel:
        block = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "mlp.w1": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(),
        }
        return TensorParallelPlan(block=block, block_input=REPLICATE, block_output=REPLICATE)

    def gather_sequence() -> Any:
        return PrepareModuleInput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_output=True,
        )

    return TensorParallelPlan(
        block={
            "ln1": SequenceParallel(use_local_output=True),
            "attention": gather_sequence(),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ln2": SequenceParallel(use_local_output=True),
            "mlp": gather_sequence(),
            "mlp.w1": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
        },
        block_input=SEQUENCE,
        block_output=SEQUENCE,
        sequence_dim=1,
    )


# -- plan checks ---------------------------------------------------------------


def _placements(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, (tuple, list)):
        return tuple(value)
    if isinstance(value, Mapping):
        return tuple(value.values())
    return (value,)


def _shards_sequence(style: Any, seq_dim: int) -> bool:
    """True when ``style`` takes or makes a tensor sharded along ``seq_dim``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    if isinstance(style, SequenceParallel):
        return True
    for nested in ("prepare_module_input", "prepare_module_output"):
        inner = getattr(style, nested, None)
        if inner is not None and _shards_sequence(inner, seq_dim):
            return True
    for attr in (
        "input_layouts",
        "output_layouts",
        "desired_input_layouts",
        "desired_output_layouts",
        "input_kwarg_layouts",
        "desired_input_kwarg_layouts",
    ):
        for p in _placements(getattr(style, attr, None)):
            if isinstance(p, Shard) and p.dim == seq_dim:
                return True
    return False


def _check_style(key: str, style: Any, where: str) -> None:
    from torch.distributed.tensor.parallel import ParallelStyle

    if not isinstance(style, ParallelStyle):
        raise RematUsageError(
            f"remat_dist.shard_model: {where} entry {key!r} is a "
            f"{type(style).__name__}, not a torch ParallelStyle (ColwiseParallel, "
            "RowwiseParallel, SequenceParallel, PrepareModuleInput, ...)."
        )


def _takes_sequence_shards(style: Any, seq_dim: int) -> bool:
    """True when ``style`` declares an input sharded along ``seq_dim`` (and so
    redistributes it itself, as ``PrepareModuleInput(input_layouts=Shard(1))``)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    if isinstance(style, SequenceParallel):
        return False
    inner = getattr(style, "prepare_module_input", None)
    if inner is not None and _takes_sequence_shards(inner, seq_dim):
        return True
    for attr in ("input_layouts", "input_kwarg_layouts"):
        for p in _placements(getattr(style, attr, None)):
            if isinstance(p, Shard) and p.dim == seq_dim:
                return True
    return False


def _check_sequence_dtensors(block: dict[str, Any], seq_dim: int) -> None:
    """Refuse, on a torch whose DTensor cannot view a sequence shard flattened
    (torch 2.11), a ``SequenceParallel(use_local_output=False)`` whose sequence-
    sharded DTensor output no style of the plan takes as such: the next module
    gets it as is, and a ``Linear`` fails deep inside DTensor."""
    from torch.distributed.tensor.parallel import SequenceParallel

    keys = [
        k
        for k, s in block.items()
        if isinstance(s, SequenceParallel) and not s.use_local_output
    ]
    if not keys or any(_takes_sequence_shards(s, seq_dim) for s in block.values()):
        return
    if _dtensor.views_sequence_shards():
        return
    import torch

    raise RematUsageError(
        f"remat_dist.shard_model: tp_plan entries {', '.join(map(repr, keys))} are "
        "SequenceParallel(use_local_output=False) and no entry takes their "
        "sequence-sharded DTensor output as such, so the next module reshapes it "
        f"as it comes: torch {torch.__version__}'s DTensor refuses to flatten a "
        "sequence shard ('Attempted to flatten multiple dimensions'); torch 2.12 "
        "and newer run such plans. Fix: install torch>=2.12, or gather the "
        "sequence before the next module (PrepareModuleInput(input_layouts="
        "Shard(1), desired_input_layouts=Replicate()), as "
        "remat_dist.shard.reference_tp_plan(sequence_parallel=True) does)."
    )


def normalize_plan(tp_plan: TPPlanLike) -> TensorParallelPlan:
    """``tp_plan`` as a checked :class:`TensorParallelPlan` with both boundary
    layouts filled in; raises :class:`RematUsageError` for a plan that cannot be
    made correct."""
    if isinstance(tp_plan, TensorParallelPlan):
        plan = tp_plan
    elif isinstance(tp_plan, Mapping):
        plan = TensorParallelPlan(block=dict(tp_plan))
    else:
        raise RematUsageError(
            "remat_dist.shard_model(tp_plan=...): expected a TensorParallelPlan or a "
            f"dict of per-block ParallelStyles, got {type(tp_plan).__name__}. Fix: "
            "remat_dist.shard.reference_tp_plan() for remat_dist.models.GPT."
        )
    for key, style in plan.block.items():
        _check_style(key, style, "tp_plan.block")
    for key, style in plan.root.items():
        _check_style(key, style, "tp_plan.root")
    seq_dim = plan.sequence_dim
    seq_keys = [k for k, s in plan.block.items() if _shards_sequence(s, seq_dim)]
    own_boundary = "" in plan.block
    block_input, block_output = plan.block_input, plan.block_output
    for label, value in (("block_input", block_input), ("block_output", block_output)):
        if value is not None and value not in _LAYOUTS:
            raise RematUsageError(
                f"remat_dist.shard_model: TensorParallelPlan.{label} must be one of "
                f"{_LAYOUTS} or None, got {value!r}."
            )
    if own_boundary and SEQUENCE in (block_input, block_output):
        raise RematUsageError(
            "remat_dist.shard_model: the block plan has a '' entry (it prepares the "
            "block's own inputs/outputs) and also block_input/block_output="
            "'sequence'. Fix: do one or the other; with a '' entry the plan must "
            "take and return full tensors (leave block_input/output None)."
        )
    if seq_keys and not own_boundary and (block_input is None or block_output is None):
        raise RematUsageError(
            "remat_dist.shard_model: the tensor-parallel block plan shards the "
            f"sequence dimension (entries {', '.join(map(repr, seq_keys))}), but does "
            "not say which layout block inputs and outputs have. A full tensor given "
            "to a sequence-parallel style is silently taken as this rank's shard and "
            "gives wrong gradients. Fix: pass TensorParallelPlan(block=plan, "
            "block_input='sequence', block_output='sequence') when the blocks expect "
            "and return this rank's sequence shard (shard_model then slices block "
            "inputs and gathers block outputs), or use "
            "remat_dist.shard.reference_tp_plan(sequence_parallel=True) for "
            "remat_dist.models.GPT."
        )
    root_seq = [k for k, s in plan.root.items() if _shards_sequence(s, seq_dim)]
    if root_seq:
        raise RematUsageError(
            "remat_dist.shard_model: tp_plan.root shards the sequence dimension "
            f"(entries {', '.join(map(repr, root_seq))}), but blocks exchange full "
            "tensors with the rest of the model, so those styles would take full "
            "tensors as shards (wrong gradients, no error). Fix: keep root entries "
            "on full tensors (ColwiseParallel/RowwiseParallel with Replicate inputs "
            "and outputs), or move sequence-parallel modules into the blocks."
        )
    _check_sequence_dtensors(plan.block, seq_dim)
    return TensorParallelPlan(
        block=dict(plan.block),
        root=dict(plan.root),
        block_input=block_input or REPLICATE,
        block_output=block_output or REPLICATE,
        sequence_dim=seq_dim,
    )

