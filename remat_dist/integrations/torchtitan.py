"""remat_dist in place of torchtitan's activation checkpointing.

torchtitan checkpoints each child of ``model.layers`` (its transformer blocks) with
torch's ``checkpoint_wrapper``, chosen by its activation-checkpoint config. This
adapter reads the same config and checkpoints the same blocks with
:func:`remat_dist.fsdp.apply_remat` instead, so a torchtitan job keeps its command
line and gets remat_dist's per-rank RNG replay, collective checks and reports.
docs/torchtitan.md is the step-by-step recipe.

torchtitan is imported lazily (only inside the functions that need it): importing
this module works without torchtitan installed, and :func:`apply_ac` runs on any
model shaped like torchtitan's (a ``layers`` container of blocks).

How the config maps
-------------------
Both shapes torchtitan has used are read (:func:`read_ac_config`):

* the older ``ActivationCheckpoint`` job config with ``mode`` (``"none"``,
  ``"full"``, ``"selective"``, ``"memory_budget"``) and ``selective_ac_option``
  (``"op"`` or a layer frequency such as ``"2"``);
* the newer policy configs (``FullAC.Config``, ``SelectiveAC.Config``,
  ``MemoryBudgetAC.Config`` or ``None``), or a policy built from one.

===================================  ==========================================
torchtitan                           remat_dist
===================================  ==========================================
``full``                             every block, ``policy="full"``
``selective``, option ``"k"`` (int)  every k-th block counting from 1 (blocks
                                     ``k-1, 2k-1, ...``; ``"0"``: every block),
                                     ``policy="full"``, as torchtitan's layer SAC
``selective``, option ``"op"``       every block, ``op_policy`` (default
                                     ``{"attention": "save"}``: keep attention's
                                     activations, recompute the rest). remat_dist
                                     selects by module region, not by aten op.
``preserve_rng_state=True``          ``recompute_state_hooks=None`` (the default
                                     per-rank RNG hooks: dropout replays exactly)
``preserve_rng_state=False``         ``recompute_state_hooks=()`` (a warning names
                                     any ``nn.Dropout`` in the blocks)
``determinism_check``                passed through (``"default"`` / ``"none"``)
``debug``, ``early_stop``            not applied (a warning names them when set)
``none`` / ``None``                  refused: :class:`RematUsageError`
``memory_budget``                    refused: it is a compiler option, no
                                     checkpoint is placed
===================================  ==========================================

When it would checkpoint nothing (mode ``none``, a config of ``None``, a layer
frequency larger than the number of blocks, a model without ``layers``),
:func:`apply_ac` *refuses* with a :class:`RematUsageError` instead of returning a
model without checkpointing: a job that asks for remat_dist and silently trains
without it measures the wrong thing. Leave the adapter out to train without AC.

MoE load-balancing token counts
-------------------------------
torchtitan's ``MoE`` adds each forward's per-expert token counts to a buffer
(``tokens_per_expert_E``; ``tokens_per_expert`` in older releases), and a
recomputed block adds them a second time. torchtitan corrects that in its
optimizer pre-hook by halving the counts of blocks whose ``checkpoint_impl`` is
``CheckpointImpl.NO_REENTRANT`` (the attribute of torch's ``CheckpointWrapper``).
Halving is right only when every forward is replayed exactly once, which
remat_dist does not promise (a ``"save"`` region is skipped on replay). So the
adapter does not set ``checkpoint_impl``; it installs a *count guard* on each
module inside a checkpointed block that holds such a buffer: while remat_dist
replays (:func:`remat_dist.is_recomputing`), that module's counts go to a scratch
tensor that is dropped afterwards (also when torch's early stop ends the replay
inside it). The buffer then holds exactly what the forward passes counted, as
without checkpointing, and torchtitan's halving stays off.

With torchtitan's override mechanism
------------------------------------
Importing this module while torchtitan's config package is loaded (which is the
case when torchtitan imports it for ``--override.imports``) registers
:func:`remat_activation_checkpoint` as an override of torchtitan's
``ActivationCheckpointing.Config``; :func:`register_torchtitan_override` does it
explicitly. See docs/torchtitan.md.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat_dist.core import RecomputeStateHook, is_recomputing
from remat_dist.errors import RematUsageError
from remat_dist.fsdp import apply_remat, remat_plan, remove_remat

__all__ = [
    "ACSettings",
    "COUNTER_BUFFERS",
    "DEFAULT_OP_POLICY",
    "apply_ac",
    "guarded_counters",
    "patch_apply_ac",
    "read_ac_config",
    "register_torchtitan_override",
    "remat_activation_checkpoint",
    "remove_ac",
    "selected_blocks",
]

log = logging.getLogger("remat_dist.integrations.torchtitan")

COUNTER_BUFFERS = ("tokens_per_expert_E", "tokens_per_expert")
"""Buffer names of torchtitan's MoE token counters (newest first)."""

DEFAULT_OP_POLICY: Mapping[str, str] = {"attention": "save"}
"""What ``selective`` with option ``"op"`` keeps per block unless ``op_policy`` says."""

MODES = ("none", "full", "selective", "memory_budget")

SETTINGS_ATTR = "_remat_dist_torchtitan_ac"
"""On each checkpointed block: the :class:`ACSettings` it was checkpointed with."""

GUARD_ATTR = "_remat_dist_count_guard"
"""On each guarded module: ``(buffer name, previous instance forward or None)``."""

_UNSET: Any = object()


@dataclass(frozen=True)
class ACSettings:
    """torchtitan's activation-checkpoint knobs, read from either config shape.

    Attributes:
        mode: ``"none"``, ``"full"``, ``"selective"`` or ``"memory_budget"``.
        selective_ac_option: ``"op"`` or a layer frequency (digits).
        preserve_rng_state: torchtitan's default is True.
        determinism_check: ``"default"`` or ``"none"``.
        debug: torchtitan's AC debug flag (not applied by remat_dist).
        early_stop: torchtitan's early-stop flag, None where the config has none
            (remat_dist follows torch's global early-stop setting).
        collectives: remat_dist's ``collectives`` mode when the config carries one
            (the override's config does), else None.
    """

    mode: str
    selective_ac_option: str = "op"
    preserve_rng_state: bool = True
    determinism_check: str = "default"
    debug: bool = False
    early_stop: bool | None = None
    collectives: str | None = None


def read_ac_config(ac_config: Any) -> ACSettings:
    """Read torchtitan's activation-checkpoint config into :class:`ACSettings`.

    Accepts the older job config (an object with ``mode`` and
    ``selective_ac_option``), the newer policy configs (``FullAC.Config``,
    ``SelectiveAC.Config``, ``MemoryBudgetAC.Config``), a policy built from one
    (anything with a ``config`` attribute), ``None`` (torchtitan's "no AC"), or a
    mode string. Raises :class:`RematUsageError` for anything else.
    """
    if ac_config is None:
        return ACSettings(mode="none")
    if isinstance(ac_config, str):
        mode = ac_config
        option = "op"
    elif hasattr(ac_config, "mode"):
        mode = str(ac_config.mode)
        option = str(getattr(ac_config, "selective_ac_option", "op"))
    elif hasattr(ac_config, "config") and not isinstance(ac_config, type):
        return read_ac_config(ac_config.config)
    else:
        name = type(ac_config).__qualname__
        owner = name.rsplit(".", 1)[0] if name.endswith(".Config") else name
        by_owner = {"FullAC": "full", "SelectiveAC": "selective", "MemoryBudgetAC": "memory_budget"}
        if owner not in by_owner:
            raise RematUsageError(
                f"remat_dist.integrations.torchtitan: cannot read an activation-checkpoint "
                f"config of type {name}. Fix: pass torchtitan's config (an object with "
                "mode/selective_ac_option, or FullAC.Config / SelectiveAC.Config), None, "
                "or a mode string ('full', 'selective')."
            )
        mode = by_owner[owner]
        option = "op"
    mode = mode.replace("-", "_")
    if mode not in MODES:
        raise RematUsageError(
            f"remat_dist.integrations.torchtitan: unknown activation-checkpoint mode "
            f"{mode!r}. Fix: one of {', '.join(MODES)}."
        )
    if mode == "selective" and option != "op" and not option.isdigit():
        raise RematUsageError(
            f"remat_dist.integrations.torchtitan: selective_ac_option {option!r} is "
            "neither 'op' nor a layer frequency. Fix: 'op' or a non-negative int "
            "such as '2'."
        )
    early = getattr(ac_config, "early_stop", None)
    collectives = getattr(ac_config, "collectives", None)
    return ACSettings(
        mode=mode,
        selective_ac_option=option,
        preserve_rng_state=bool(getattr(ac_config, "preserve_rng_state", True)),
        determinism_check=str(getattr(ac_config, "determinism_check", "default")),
        debug=bool(getattr(ac_config, "debug", False)),
        early_stop=None if early is None else bool(early),
        collectives=None if collectives is None else str(collectives),
    )


def _blocks(model: nn.Module, layers: str) -> list[tuple[str, nn.Module]]:
    try:
        container = model.get_submodule(layers)
    except AttributeError:
        raise RematUsageError(
            f"remat_dist.integrations.torchtitan: the model ({type(model).__name__}) "
            f"has no {layers!r} submodule, so there are no transformer blocks to "
            "checkpoint. Fix: pass layers='<path of the block container>', or use "
            "remat_dist.fsdp.apply_remat(model, blocks=...) directly."
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
            if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p > 0
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
    for name in remat_plan(model):
        if name not in names:
            continue
        block = model.get_submodule(name)
        block.__dict__[SETTINGS_ATTR] = settings
        guarded += _guard_counters(block)
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


def _guard_counters(block: nn.Module) -> int:
    count = 0
    for module in block.modules():
        buffer = next((b for b in COUNTER_BUFFERS if b in module._buffers), None)
        if buffer is None or GUARD_ATTR in module.__dict__:
            continue
        _install_guard(module, buffer)
        count += 1
    return count


def _install_guard(module: nn.Module, buffer: str) -> None:
    previous = module.__dict__.get("forward")
    inner = previous if previous is not None else type(module).forward.__get__(module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not is_recomputing():
            return inner(*args, **kwargs)
        real = module._buffers[buffer]
        # The replay counts into a scratch tensor; the forward already counted.
        module._buffers[buffer] = torch.zeros_like(real)
        try:
            return inner(*args, **kwargs)
        finally:
            module._buffers[buffer] = real

    module.forward = forward
    module.__dict__[GUARD_ATTR] = (buffer, previous)


def guarded_counters(model: nn.Module) -> list[str]:
    """Qualified names of the modules whose MoE token counter :func:`apply_ac`
    guards."""
    return [name for name, m in model.named_modules() if GUARD_ATTR in m.__dict__]


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


# --- torchtitan's override mechanism (newer torchtitan) ----------------------------

_override_class: Any = None


def _remat_ac_config_class() -> Any:
    """The ``Configurable.Config`` that :func:`remat_activation_checkpoint` returns,
    built on first use (it subclasses torchtitan's classes)."""
    global _override_class
    if _override_class is not None:
        return _override_class
    from dataclasses import dataclass as config_dataclass

    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing

    class RematAC(ActivationCheckpointing):
        """remat_dist's checkpointing in torchtitan's policy slot."""

        @config_dataclass(kw_only=True, slots=True)
        class Config(ActivationCheckpointing.Config):
            mode: str = "full"
            """torchtitan's mode this replaces: ``"full"`` or ``"selective"``."""
            selective_ac_option: str = "op"
            """``"op"`` or a layer frequency, as torchtitan's selective AC."""
            collectives: str = "replay"
            """remat_dist's ``collectives`` mode for every checkpoint."""

        def apply(self, model: nn.Module) -> None:
            apply_ac(model, self.config)

    # torchtitan's override log names the classes by qualified name
    RematAC.__qualname__ = "RematAC"
    RematAC.Config.__qualname__ = "RematAC.Config"
    _override_class = RematAC.Config
    return _override_class


def remat_activation_checkpoint(
    cfg: Any, *, collectives: str = "replay", selective_ac_option: str | None = None
) -> Any:
    """torchtitan ``@override`` factory: replace the activation-checkpoint config
    ``cfg`` (``FullAC.Config`` / ``SelectiveAC.Config``) by remat_dist's, which
    checkpoints the same blocks through :func:`apply_ac`.

    Activate it with ``--override.imports
    remat_dist.integrations.torchtitan.remat_activation_checkpoint``; keyword
    arguments come from the import entry (``...={"collectives": "save"}``).
    ``MemoryBudgetAC`` is refused.
    """
    settings = read_ac_config(cfg)
    if settings.mode not in ("full", "selective"):
        raise RematUsageError(
            f"remat_dist.integrations.torchtitan: cannot replace torchtitan's "
            f"{settings.mode!r} activation checkpointing by remat_dist. Fix: choose "
            "full or selective activation checkpointing, or drop the override."
        )
    config_class = _remat_ac_config_class()
    return config_class(
        mode=settings.mode,
        selective_ac_option=selective_ac_option or settings.selective_ac_option,
        collectives=collectives,
        preserve_rng_state=settings.preserve_rng_state,
        determinism_check=settings.determinism_check,
        debug=settings.debug,
    )


def register_torchtitan_override() -> bool:
    """Register :func:`remat_activation_checkpoint` with torchtitan's override
    registry (target: ``ActivationCheckpointing.Config``). Returns True when it
    registered now, False when it already was. Needs torchtitan."""
    from torchtitan.config.override import override
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing

    try:
        override(
            target=ActivationCheckpointing.Config,
            description="remat_dist in place of torchtitan's activation checkpointing",
        )(remat_activation_checkpoint)
    except ValueError:  # already registered under this module.function
        return False
    return True


if "torchtitan.config.override" in sys.modules:
    # torchtitan is importing this module for --override.imports: register now.
    try:
        register_torchtitan_override()
    except Exception as exc:  # pragma: no cover - depends on torchtitan's version
        log.warning("could not register the torchtitan override: %s", exc)
