"""torchtitan's override mechanism (newer torchtitan): remat_dist's adapter as an
override of ``ActivationCheckpointing.Config`` (see docs/torchtitan.md)."""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

from torch import nn

from remat_dist._errors import RematUsageError
from remat_dist.integrations.torchtitan._apply import apply_ac
from remat_dist.integrations.torchtitan._config import read_ac_config

__all__ = ["register_torchtitan_override", "remat_activation_checkpoint"]

log = logging.getLogger("remat_dist.integrations.torchtitan")

# --- torchtitan's override mechanism (newer torchtitan) ----------------------------


@functools.cache
def _remat_ac_config_class() -> Any:
    """The ``Configurable.Config`` that :func:`remat_activation_checkpoint` returns,
    built once, on first use (it subclasses torchtitan's classes)."""
    from dataclasses import dataclass as config_dataclass

    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing

    class RematDistAC(ActivationCheckpointing):
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
    RematDistAC.__qualname__ = "RematDistAC"
    RematDistAC.Config.__qualname__ = "RematDistAC.Config"
    return RematDistAC.Config


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


# torchtitan's registry names an override by its function's module: the public one
remat_activation_checkpoint.__module__ = "remat_dist.integrations.torchtitan"


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
