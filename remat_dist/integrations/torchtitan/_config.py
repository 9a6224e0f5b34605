"""torchtitan's activation-checkpoint config, read from either of its shapes
(:func:`read_ac_config`), and the adapter's constants."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from remat_dist._errors import RematUsageError

__all__ = ["ACSettings", "COUNTER_BUFFERS", "DEFAULT_OP_POLICY", "read_ac_config"]

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
