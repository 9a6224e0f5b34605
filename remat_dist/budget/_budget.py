"""``MemoryBudget``: the policy a user passes to ``apply_remat`` to keep at most a
number of bytes per rank; a ``remat_dist.wrap.PlannedPolicy`` whose planner is
``remat_dist.budget._planner``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from remat_dist._errors import RematUsageError
from remat_dist.budget._planner import RankShare, prepare
from remat_dist.budget._profile import parse_bytes
from remat_dist.wrap import BlockInstaller

__all__ = ["MemoryBudget"]


@dataclass(frozen=True)
class MemoryBudget:
    """A policy for :func:`apply_remat`: keep at most ``bytes`` of activations saved
    for backward per rank, and recompute as little as possible.

    The planner measures every candidate of every block in the first training
    step, and how many forwards that step keeps alive at once (a pipeline
    schedule's micro-batches in flight), then chooses the plan of least recompute
    time whose peak fits the budget on the rank that needs most among the ranks
    that run the model alike (its TP / FSDP2 ranks: one plan per pipeline stage;
    see ``docs/memory_budget.md``)::

        apply_remat(model, blocks=Block, policy=MemoryBudget(bytes="2GiB"))

    Under ``torch.compile``, do not compile the blocks yourself: pass
    ``compile=`` (``True`` or ``torch.compile``'s options) and the planner
    compiles each block once its plan is installed (the profiling step runs
    eagerly; one compile per block, for the plan)::

        MemoryBudget(bytes="2GiB", compile={"fullgraph": True})

    One object is one budget for the rank: given to several models on a rank
    (the stage modules of an interleaved pipeline schedule), they plan jointly,
    at the end of the last one's profiling step, so that their peaks together
    fit ``bytes``; separate objects, even equal ones, are separate budgets.

    Attributes:
        bytes: the budget as given (a number of bytes or a size such as
            ``"8GiB"``) for everything the rank saves for backward in a step:
            the model, what runs outside its blocks, and the loss.

    Example::

        budget = remat_dist.MemoryBudget(bytes="8GiB")
        remat_dist.apply_remat(model, blocks=Block, policy=budget)
        loss = F.cross_entropy(model(x), y)  # the profiling step counts the loss
        loss.backward()
        print(remat_dist.budget.current_plan(model).format())

    Raises :class:`RematUsageError` for a byte count it cannot read, a negative
    one or one that is not a whole number of bytes, and for regions that are not
    distinct non-empty strings; ``apply_remat`` raises for regions a block does not
    have (naming the block and its submodules).
    """

    bytes: int | str
    """The budget per rank: the most bytes saved for backward alive at once in
    a training step, every forward whose graph is alive counted (the
    micro-batches a pipeline schedule keeps in flight), each as
    ``remat_dist.testing.SavedBytesCounter`` counts them around ``model(batch)``
    (unique storages, parameters excluded), with what its loss saves after it
    (``F.cross_entropy(model(x), y)``, a schedule's ``loss_fn``; see
    ``docs/memory_budget.md`` for a loss it cannot see). Without micro-batches in
    flight, one forward and its loss. An int, or a string with a suffix
    (``"1.5GiB"``, ``"512MiB"``, ``"2GB"``); stored as an int."""
    regions: Sequence[str] | None = None
    """Submodule paths (relative to each block) that may be kept as save regions:
    every non-empty subset is a candidate, besides full recompute and no checkpoint
    (at most 4). None: the block's direct children named in
    ``DEFAULT_REGION_NAMES`` (``attention``, ``attn``, ``self_attn``, ``mlp``,
    ``feed_forward``, ``ffn``). ``()``: only full recompute or nothing."""
    repeats: int = 3
    """Timed forwards per block in the profiling step; the minimum is kept (the
    least noisy estimate on a busy machine)."""
    measure_peak: bool = False
    """Follow this rank's activation bytes through every step once the plan
    runs, for the cross-rank report (``gather_saved_tensors_report`` shows the
    peak since its previous call). Costs one Python pack hook call per saved
    tensor of every forward; off, the budget costs nothing per step."""

    compile: bool | Mapping[str, Any] = False
    """Compile each block (``block.compile(**options)``) once the plan is
    installed: ``True`` for torch.compile's defaults, or a mapping of its
    options (``{"fullgraph": True, "backend": "inductor"}``). Stored as a
    sorted tuple of ``(option, value)`` pairs, or ``False``. The blocks run
    eagerly in the profiling step."""

    plan_against: str = "peak"
    """For models sharing the budget (one object given to a rank's stage
    modules): ``"peak"`` plans against the forwards of each model alive at
    once at the moments the profiling step showed (the rank's measured
    concurrent peak); ``"sum"`` against every model at its own peak at once,
    an upper bound that also holds for a schedule whose later steps overlap
    the models' forwards otherwise than the profiling step did (more
    recompute). Alike for a budget of one model."""

    def __post_init__(self) -> None:
        try:
            value = parse_bytes(self.bytes)
        except ValueError as e:
            raise RematUsageError(f"remat_dist.MemoryBudget(bytes=...): {e}") from None
        if value < 0:
            raise RematUsageError(
                f"remat_dist.MemoryBudget(bytes={self.bytes!r}): the budget must not be "
                "negative."
            )
        object.__setattr__(self, "bytes", value)
        if self.regions is not None:
            regions = (self.regions,) if isinstance(self.regions, str) else tuple(self.regions)
            for path in regions:
                if not isinstance(path, str) or not path:
                    raise RematUsageError(
                        f"remat_dist.MemoryBudget(regions={self.regions!r}): every region "
                        f"is a non-empty submodule path relative to the block, got "
                        f"{path!r}. Fix: e.g. regions=('attention', 'mlp'), or regions=() "
                        "for full recompute or nothing."
                    )
            twice = sorted({p for p in regions if regions.count(p) > 1})
            if twice:
                raise RematUsageError(
                    f"remat_dist.MemoryBudget(regions={self.regions!r}): "
                    f"{', '.join(map(repr, twice))} listed more than once. Fix: list each "
                    "submodule once."
                )
            object.__setattr__(self, "regions", regions)
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise RematUsageError(
                f"remat_dist.MemoryBudget(repeats={self.repeats!r}): must be a positive int."
            )
        if self.compile is True:
            object.__setattr__(self, "compile", ())
        elif isinstance(self.compile, Mapping):
            object.__setattr__(self, "compile", tuple(sorted(self.compile.items())))
        elif not (self.compile is False or isinstance(self.compile, tuple)):
            raise RematUsageError(
                f"remat_dist.MemoryBudget(compile={self.compile!r}): must be True, False "
                "or a mapping of torch.compile options, e.g. {'fullgraph': True}."
            )
        if self.plan_against not in ("peak", "sum"):
            raise RematUsageError(
                f"remat_dist.MemoryBudget(plan_against={self.plan_against!r}): must be "
                "'peak' (the concurrent peak the profiling step measured) or 'sum' "
                "(every model sharing the budget at its own peak at once)."
            )
        if not isinstance(self.measure_peak, bool):
            raise RematUsageError(
                f"remat_dist.MemoryBudget(measure_peak={self.measure_peak!r}): must be "
                "True or False."
            )
        # one object is one budget for the rank: the models given this object
        # plan together (see RankShare); not a field, so equal budgets stay equal
        object.__setattr__(self, "_share", RankShare())

    # -- the planned-policy seam (remat_dist.wrap._planned)
    def with_regions(self, regions: Sequence[str]) -> MemoryBudget:
        """This budget with ``regions`` as the save-region candidates: still the
        same budget (the models given either object plan together)."""
        new = dataclasses.replace(self, regions=tuple(regions))
        object.__setattr__(new, "_share", self._share)  # type: ignore[attr-defined]
        return new

    def planner(self, model: nn.Module, installer: BlockInstaller) -> Callable[[], Any]:
        """Check the regions against the blocks (raising before anything changes);
        the call that attaches the planner once the blocks are checkpointed."""
        return prepare(self, model, installer)
