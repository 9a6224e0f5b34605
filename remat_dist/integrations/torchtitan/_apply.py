"""Checkpoint a torchtitan model's blocks as its activation-checkpoint config says
(:func:`apply_ac`), undo it (:func:`remove_ac`), and patch torchtitan's own
``apply_ac`` (:func:`patch_apply_ac`)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

from torch import nn

from remat_dist._errors import RematUsageError
from remat_dist._torch._module import DropoutBase
from remat_dist.core import RecomputeStateHook
from remat_dist.integrations.torchtitan._config import (
    _UNSET,
    DEFAULT_OP_POLICY,
    GUARD_ATTR,
    SETTINGS_ATTR,
    ACSettings,
    read_ac_config,
)
from remat_dist.integrations.torchtitan._guards import guard_counters
from remat_dist.wrap import apply_remat, checkpointed_blocks, remove_remat

__all__ = ["apply_ac", "patch_apply_ac", "remove_ac", "selected_blocks"]

log = logging.getLogger("remat_dist.integrations.torchtitan")

def _blocks(model: nn.Module, layers: str) -> list[tuple[str, nn.Module]]:
    try:
        container = model.get_submodule(layers)
    except AttributeError:
        raise RematUsageError(
            f"remat_dist.integrations.torchtitan: the model ({type(model).__name__}) "
            f"has no {layers!r} submodule, so there are no transformer blocks to "
            "checkpoint. Fix: pass layers='<path of the block container>', or use "
            "remat_dist.apply_remat(model, blocks=...) directly."
        ) from None
    return [(f"{layers}.{name}", block) for name, block in container.named_children()]


def selected_blocks(
    model: nn.Module, ac_config: Any, *, layers: str = "layers"
) -> list[str]:
    """Qualified names of the blocks :func:`apply_ac` would checkpoint (may be
    empty: ``apply_ac`` refuses that)."""
    settings = read_ac_config(ac_config)
    return _select(model, settings, layers)


def _select(model: nn.Module, settings: ACSettings, layers: str) -> list[str]:
    if settings.mode not in ("full", "selective"):
        return []
    names = [name for name, _ in _blocks(model, layers)]
    if settings.mode == "selective" and settings.selective_ac_option != "op":
        every = int(settings.selective_ac_option)
        if every > 0:
            # torchtitan counts blocks from 1 and wraps those whose count is a
            # multiple of the frequency.
            names = [n for i, n in enumerate(names) if (i + 1) % every == 0]
    return names


def apply_ac(
    model: nn.Module,
    ac_config: Any,
    *,
    layers: str = "layers",
    collectives: str | None = None,
    recompute_state_hooks: Sequence[RecomputeStateHook] | None = _UNSET,
    op_policy: Any = None,
) -> nn.Module:
    """Checkpoint ``model``'s transformer blocks with remat_dist, as torchtitan's
    activation-checkpoint config says; returns ``model``.

    Call it where torchtitan applies its own AC (in the model's parallelize
    function, before ``torch.compile`` and FSDP), instead of torchtitan's
    ``apply_ac`` / ``ac_config.build().apply(model)``.

    Args:
        model: a torchtitan-shaped model: ``model.<layers>`` holds the blocks.
        ac_config: torchtitan's activation-checkpoint config (see
            :func:`read_ac_config`).
        layers: path of the block container.
        collectives: remat_dist's ``collectives`` mode (``"replay"`` re-issues and
            checks tensor-parallel collectives on replay, ``"save"`` keeps their
            outputs). None: the config's, else ``"replay"``.
        recompute_state_hooks: passed to ``apply_remat``; by default derived from
            the config's ``preserve_rng_state`` (True: remat_dist's default
            per-rank RNG hooks; False: none).
        op_policy: the ``apply_remat`` policy used for ``selective`` with option
            ``"op"`` (default :data:`DEFAULT_OP_POLICY`).

    Raises :class:`RematUsageError` when the config would checkpoint nothing
    (``none``, ``None``, ``memory_budget``, no block selected); a model part whose
    block container is empty (a pipeline stage with only the embedding or the
    output) is returned unchanged, with an info log, as torchtitan does. Each checkpointed
    block gets a count guard on its MoE token counters (see the module docs) and
    the attribute ``_remat_dist_torchtitan_ac`` holding the settings used;
    :func:`remove_ac` undoes all of it.
    """
    settings = read_ac_config(ac_config)
    where = "remat_dist.integrations.torchtitan.apply_ac"
    if settings.mode == "none":
        raise RematUsageError(
            f"{where}: torchtitan's activation checkpointing is off (mode 'none' or no "
            "config), so remat_dist would checkpoint nothing. Fix: choose full or "
            "selective activation checkpointing (e.g. --activation_checkpoint.mode "
            "full), or leave the remat_dist adapter out to train without it."
        )
    if settings.mode == "memory_budget":
        raise RematUsageError(
            f"{where}: torchtitan's memory_budget mode is a torch.compile partitioner "
            "setting; it places no checkpoint for remat_dist to replace. Fix: choose "
            "full or selective activation checkpointing, or leave the adapter out."
        )
    if not _blocks(model, layers):
        # a pipeline stage holding only the embedding or the output: nothing of
        # this model part to checkpoint, as torchtitan's own AC says
        log.info("%s: no transformer blocks in this model part (%r is empty)", where, layers)
        return model
    names = _select(model, settings, layers)
    if not names:
        raise RematUsageError(
            f"{where}: the config ({settings.mode}, option "
            f"{settings.selective_ac_option!r}) selects none of the "
            f"{len(_blocks(model, layers))} blocks under {layers!r}, so remat_dist "
            "would checkpoint nothing. Fix: a smaller layer frequency, or full AC."
        )
    ignored = [k for k in ("debug",) if getattr(settings, k)]
    if settings.early_stop is False:
        ignored.append("early_stop=False")
    if ignored:
        warnings.warn(
            f"{where}: torchtitan's AC option(s) {', '.join(ignored)} are not applied "
            "by remat_dist (replay stops early as torch's global setting says; use "
            "remat_dist's reports and REMAT_DIST_LOG=debug to see replays).",
            stacklevel=2,
        )
    if settings.mode == "selective" and settings.selective_ac_option == "op":
        policy = dict(DEFAULT_OP_POLICY) if op_policy is None else op_policy
    else:
        policy = "full"
    if recompute_state_hooks is _UNSET:
        recompute_state_hooks = None if settings.preserve_rng_state else ()
        dropout = [
            f"{n}.{sub_name}" if sub_name else n
            for n in names
            for sub_name, sub in model.get_submodule(n).named_modules()
            if isinstance(sub, DropoutBase) and sub.p > 0
        ]
        if not settings.preserve_rng_state and dropout:
            warnings.warn(
                f"{where}: preserve_rng_state=False with dropout in the checkpointed "
                f"blocks ({', '.join(dropout[:3])}{', ...' if len(dropout) > 3 else ''}): "
                "as with torchtitan's own AC, the replay draws other dropout masks than "
                "the forward, so the gradients are not those of training without AC "
                "(remat_dist.checkpoint's own preserve_rng_state=False, torch_remat's "
                "default, still replays RNG). Fix: preserve_rng_state=True in the AC "
                "config.",
                stacklevel=2,
            )
    mode = collectives or settings.collectives or "replay"
    apply_remat(
        model,
        blocks=names,
        policy=policy,
        recompute_state_hooks=recompute_state_hooks,
        collectives=mode,
        determinism_check=settings.determinism_check,
    )
    guarded = 0
    for name in checkpointed_blocks(model):
        if name not in names:
            continue
        block = model.get_submodule(name)
        block.__dict__[SETTINGS_ATTR] = settings
        guarded += guard_counters(block)
    log.info(
        "torchtitan AC %s%s -> remat_dist on %d block(s), policy=%r, collectives=%s, "
        "%d MoE token counter(s) guarded",
        settings.mode,
        f" ({settings.selective_ac_option})" if settings.mode == "selective" else "",
        len(names),
        policy,
        mode,
        guarded,
    )
    return model


def remove_ac(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_ac` (count guards, settings marks and the checkpoints);
    returns ``model``."""
    for module in model.modules():
        guard = module.__dict__.pop(GUARD_ATTR, None)
        if guard is not None:
            previous = guard[1]
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        module.__dict__.pop(SETTINGS_ATTR, None)
    return remove_remat(model)


def patch_apply_ac(module: Any, **options: Any) -> None:
    """Make ``module.apply_ac`` (torchtitan's function, as imported by a model's
    parallelize module in releases whose AC config has ``mode``) call
    :func:`apply_ac` instead; ``options`` are passed on (``collectives=...``).

    For torchtitan releases without the override mechanism: call it from the
    module named by ``--experimental.custom_import``, e.g. with the parallelize
    module of the model you train. torchtitan's extra keyword arguments
    (``model_compile_enabled``, ``base_folder``, op-SAC save lists, ...) are
    accepted and not used. Undo with ``module.apply_ac = module.apply_ac.torchtitan``.
    """
    original = getattr(module, "apply_ac", None)
    if original is None:
        raise RematUsageError(
            f"remat_dist.integrations.torchtitan.patch_apply_ac: {module!r} has no "
            "apply_ac to replace. Fix: pass the parallelize module that calls "
            "torchtitan's apply_ac (or use the override factory on newer releases)."
        )
    original = getattr(original, "torchtitan", original)

    def remat_apply_ac(model: nn.Module, ac_config: Any, *args: Any, **ignored: Any) -> nn.Module:
        return apply_ac(model, ac_config, **options)

    remat_apply_ac.torchtitan = original  # type: ignore[attr-defined]
    module.apply_ac = remat_apply_ac
