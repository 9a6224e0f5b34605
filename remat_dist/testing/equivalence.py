"""``assert_remat_equivalent``: check in your own tests that remat changes nothing.

Remat must be invisible to training: the same seeds must give the same losses,
gradients and parameters with and without it. The helper builds the model twice
(same seed), trains one plainly and one with :func:`remat_dist.apply_remat`
for ``steps`` optimizer steps, and compares. Bitwise by default: on CPU with
deterministic ops remat recomputes exactly what the forward computed, so any
difference is a bug (an RNG not restored on replay, a buffer changed in place, a
non-deterministic op). Under FSDP2 / tensor parallelism call it on every rank (in a
``remat_dist.testing.distributed`` test) with ``shard=`` doing the sharding; each
rank compares its own shards::

    from remat_dist.testing.equivalence import assert_remat_equivalent

    def test_my_model_remat():
        assert_remat_equivalent(
            lambda: MyModel(cfg),
            (tokens, targets),
            blocks=MyBlock,
            policy={"attention": "save"},
            steps=3,
            loss_fn=lambda model, batch: model.loss(*batch),
            recompute_state_hooks=(CPURNGStateHook(),),  # dropout on CPU
        )

The pieces (:func:`train_steps`, :func:`compare_results`) are public too, for tests
that compare against other references (a single-process run of a sharded model).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat_dist._torch._pytree import tree_leaves

__all__ = [
    "EquivalenceReport",
    "Mismatch",
    "TrainResult",
    "assert_remat_equivalent",
    "compare_results",
    "default_loss",
    "local_tensor",
    "train_steps",
]


@dataclass
class TrainResult:
    """What :func:`train_steps` observed.

    Attributes:
        losses: the loss of each step (Python floats, this rank's).
        grads: ``{parameter name: gradient}`` after the last backward (this rank's
            local shard for DTensor parameters; None where a parameter got none).
        params: ``{parameter name: value}`` after the last optimizer step (local
            shards, detached copies).
        structure: ``[(qualified module name, module type)]`` of the trained model.
        state_dict_keys: its ``state_dict()`` keys, in order.
    """

    losses: list[float]
    grads: dict[str, torch.Tensor | None]
    params: dict[str, torch.Tensor]
    structure: list[tuple[str, type]] = field(default_factory=list)
    state_dict_keys: list[str] = field(default_factory=list)


@dataclass
class Mismatch:
    """One tensor (or loss) that differs.

    Attributes:
        what: ``"grad"``, ``"param"`` or ``"loss"``.
        name: the parameter name (or ``"step {i}"`` for a loss).
        max_abs_diff: largest absolute difference (``inf`` for a shape mismatch or
            a gradient present on one side only).
        detail: a short human-readable description.
    """

    what: str
    name: str
    max_abs_diff: float
    detail: str


@dataclass
class EquivalenceReport:
    """The outcome of :func:`assert_remat_equivalent` (returned when it passes).

    Attributes:
        reference: the run without remat.
        remat: the run with remat.
        checkpointed: qualified names of the blocks that were checkpointed.
        max_grad_diff: largest absolute gradient difference over all parameters.
        max_param_diff: largest absolute parameter difference.
        mismatches: everything outside the tolerance (empty when it passed).
    """

    reference: TrainResult
    remat: TrainResult
    checkpointed: list[str]
    max_grad_diff: float
    max_param_diff: float
    mismatches: list[Mismatch]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's local data of ``t`` (``to_local()`` for a DTensor), detached."""
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover - torch without DTensor
        DTensor = ()  # type: ignore[assignment]  # noqa: N806
    if isinstance(t, DTensor):  # type: ignore[arg-type]
        t = t.to_local()
    return t.detach()


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(*batch)`` for a tuple batch (``model(batch)`` otherwise), summed
    over every tensor in the output, in float32."""
    out = model(*batch) if isinstance(batch, tuple) else model(batch)
    leaves = [
        t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
    ]
    if not leaves:
        raise TypeError(
            "assert_remat_equivalent: the model returned no tensor; pass loss_fn="
        )
    total = leaves[0].float().sum()
    for t in leaves[1:]:
        total = total + t.float().sum()
    return total


def _default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(list(params), lr=0.05, momentum=0.9)


def _batch(inputs: Any, step: int) -> Any:
    return inputs(step) if callable(inputs) else inputs


def train_steps(
    model: nn.Module,
    inputs: Any,
    *,
    steps: int = 1,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    | None = None,
    seed: int | None = 0,
) -> TrainResult:
    """Train ``model`` for ``steps`` optimizer steps and record what happened.

    Args:
        inputs: the batch used at every step, or a callable ``step -> batch``.
        loss_fn: ``(model, batch) -> scalar loss`` (default :func:`default_loss`).
        make_optimizer: ``params -> optimizer`` (default SGD, lr 0.05, momentum
            0.9).
        seed: ``torch.manual_seed`` right before the first step (None: leave the
            generators alone), so that two runs draw the same dropout masks.
    """
    if steps < 1:
        raise ValueError(f"steps must be positive: {steps!r}")
    loss_fn = loss_fn or default_loss
    opt = (make_optimizer or _default_optimizer)(model.parameters())
    if seed is not None:
        torch.manual_seed(seed)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, _batch(inputs, step))
        loss.backward()
        opt.step()
        losses.append(float(local_tensor(loss).float()))
    grads = {
        name: None if p.grad is None else local_tensor(p.grad).clone()
        for name, p in model.named_parameters()
    }
    params = {name: local_tensor(p).clone() for name, p in model.named_parameters()}
    return TrainResult(
        losses=losses,
        grads=grads,
        params=params,
        structure=[(n, type(m)) for n, m in model.named_modules()],
        state_dict_keys=list(model.state_dict().keys()),
    )


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    d = (a.double() - b.double()).abs()
    # NaN on one side only is a mismatch; NaN on both at the same place is not.
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if bool((nan_a != nan_b).any()):
        return math.inf
    d = torch.where(nan_a & nan_b, torch.zeros_like(d), d)
    return float(d.max())


def _close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> bool:
    if atol == 0 and rtol == 0:
        if torch.equal(a, b):
            return True
        # torch.equal says NaN != NaN; NaNs at the same places are equal here.
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        return torch.equal(nan_a, nan_b) and torch.equal(
            torch.where(nan_a, 0.0, a), torch.where(nan_b, 0.0, b)
        )
    return torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True)


def compare_results(
    reference: TrainResult,
    candidate: TrainResult,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    compare_losses: bool = True,
) -> tuple[list[Mismatch], float, float]:
    """``(mismatches, max_grad_diff, max_param_diff)`` between two runs.

    ``atol == rtol == 0`` means bitwise (``torch.equal``; NaNs at the same places
    count as equal); otherwise ``torch.allclose``.
    """
    mismatches: list[Mismatch] = []
    worst = {"grad": 0.0, "param": 0.0}
    if compare_losses:
        if len(reference.losses) != len(candidate.losses):
            mismatches.append(
                Mismatch(
                    "loss",
                    "steps",
                    math.inf,
                    f"{len(reference.losses)} vs {len(candidate.losses)} steps",
                )
            )
        pairs = zip(reference.losses, candidate.losses, strict=False)
        for i, (a, b) in enumerate(pairs):
            ta = torch.tensor(a, dtype=torch.float64)
            tb = torch.tensor(b, dtype=torch.float64)
            if not _close(ta, tb, atol, rtol):
                mismatches.append(
                    Mismatch("loss", f"step {i}", abs(a - b), f"loss {a!r} vs {b!r}")
                )
    for what, ref, cand in (
        ("grad", reference.grads, candidate.grads),
        ("param", reference.params, candidate.params),
    ):
        if list(ref) != list(cand):
            missing = sorted(set(ref) ^ set(cand))
            mismatches.append(
                Mismatch(
                    what, ", ".join(missing[:4]), math.inf, "parameter names differ"
                )
            )
        for name in ref:
            if name not in cand:
                continue
            a, b = ref[name], cand[name]
            if a is None or b is None:
                if (a is None) != (b is None):
                    side = "reference" if a is None else "remat"
                    mismatches.append(
                        Mismatch(what, name, math.inf, f"no gradient in the {side} run")
                    )
                continue
            if a.shape != b.shape or a.dtype != b.dtype:
                mismatches.append(
                    Mismatch(
                        what,
                        name,
                        math.inf,
                        f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}",
                    )
                )
                continue
            d = _diff(a, b)
            worst[what] = max(worst[what], d)
            if not _close(a, b, atol, rtol):
                mismatches.append(Mismatch(what, name, d, f"max abs diff {d:.3e}"))
    return mismatches, worst["grad"], worst["param"]


def assert_remat_equivalent(
    build_model: Callable[[], nn.Module],
    inputs: Any,
    *,
    blocks: Any,
    policy: Any = "full",
    steps: int = 1,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    recompute_state_hooks: Sequence[Any] | None = None,
    collectives: str = "replay",
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    | None = None,
    shard: Callable[[nn.Module], nn.Module | None] | None = None,
    remat_first: bool = True,
    seed: int = 0,
    check_structure: bool = True,
) -> EquivalenceReport:
    """Assert that ``build_model()`` trains the same with remat as without.

    Args:
        build_model: makes a fresh model; called twice, each time right after
            ``torch.manual_seed(seed)``.
        inputs: the batch for every step, or a callable ``step -> batch``.
        blocks, policy, recompute_state_hooks, collectives: passed to
            :func:`remat_dist.apply_remat`. Dropout needs the generators it
            draws from in ``recompute_state_hooks`` (or the default set).
        steps: optimizer steps to train.
        loss_fn: ``(model, batch) -> scalar loss`` (default: the sum of the
            outputs).
        atol, rtol: tolerances; both 0 (default) means bitwise equality.
        make_optimizer: ``params -> optimizer`` (default SGD with momentum).
        shard: ``model -> model`` applied to both models (e.g. ``lambda m:
            shard_model(m, mesh, blocks=Block)``); its return value, when not None,
            replaces the model.
        remat_first: with ``shard``: apply remat before sharding (True) or after.
        seed: the seed of both builds and both training runs.
        check_structure: also require equal module names and types and
            ``state_dict`` keys (remat must not wrap or rename anything).

    Returns an :class:`EquivalenceReport`; raises ``AssertionError`` listing the
    tensors that differ (and by how much) otherwise.
    """
    from remat_dist.wrap import apply_remat, checkpointed_blocks

    def build(with_remat: bool) -> nn.Module:
        torch.manual_seed(seed)
        model = build_model()

        def remat(m: nn.Module) -> None:
            if with_remat:
                apply_remat(
                    m,
                    blocks=blocks,
                    policy=policy,
                    recompute_state_hooks=recompute_state_hooks,
                    collectives=collectives,
                )

        if shard is None:
            remat(model)
            return model
        if remat_first:
            remat(model)
        out = shard(model)
        model = model if out is None else out
        if not remat_first:
            remat(model)
        return model

    common = {
        "steps": steps,
        "loss_fn": loss_fn,
        "make_optimizer": make_optimizer,
        "seed": seed,
    }
    reference = train_steps(build(False), inputs, **common)
    remat_model = build(True)
    checkpointed = list(checkpointed_blocks(remat_model))
    candidate = train_steps(remat_model, inputs, **common)
    mismatches, gmax, pmax = compare_results(reference, candidate, atol=atol, rtol=rtol)
    if check_structure:
        ref_s, cand_s = reference.structure, candidate.structure
        if ref_s != cand_s:
            if len(ref_s) == len(cand_s):
                diff = next(
                    (a, b) for a, b in zip(ref_s, cand_s, strict=True) if a != b
                )
            else:
                diff = (f"{len(ref_s)} modules", f"{len(cand_s)} modules")
            mismatches.append(
                Mismatch("structure", "modules", math.inf, f"{diff[0]} vs {diff[1]}")
            )
        if reference.state_dict_keys != candidate.state_dict_keys:
            mismatches.append(
                Mismatch("structure", "state_dict", math.inf, "state_dict keys differ")
            )
    report = EquivalenceReport(
        reference, candidate, checkpointed, gmax, pmax, mismatches
    )
    if mismatches:
        tol = "bitwise" if atol == 0 and rtol == 0 else f"atol={atol:g}, rtol={rtol:g}"
        shown = "\n".join(f"  {m.what} {m.name}: {m.detail}" for m in mismatches[:12])
        more = (
            f"\n  ... and {len(mismatches) - 12} more" if len(mismatches) > 12 else ""
        )
        raise AssertionError(
            f"remat changed training ({tol}, policy={policy!r}, {steps} step(s), "
            f"checkpointed {checkpointed}): max grad diff {gmax:.3e}, max param "
            f"diff {pmax:.3e}\n{shown}{more}\nIf the model uses dropout, pass the "
            "generators it draws from as recompute_state_hooks (e.g. "
            "remat_dist.distributed.default_state_hooks(cpu=True))."
        )
    return report
