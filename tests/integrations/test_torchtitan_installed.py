"""The adapter against torchtitan itself; skipped where torchtitan is not installed.

Runs the stand-in model (tests/integrations/_standin.py) under the real
torchtitan's AC configs and override registry, and, where this torchtitan's MoE
can be built from its config, a real torchtitan MoE inside a checkpointed block.
"""

from __future__ import annotations

import pytest
import torch

from remat_dist.wrap import checkpointed_blocks
from tests.integrations import _standin as S

ac = pytest.importorskip("torchtitan.distributed.activation_checkpoint")

from remat_dist import RematUsageError  # noqa: E402
from remat_dist.integrations import torchtitan as tt  # noqa: E402


def _configs():
    if hasattr(ac, "FullAC"):  # policy classes (torchtitan >= 0.3)
        return ac.FullAC.Config(), ac.SelectiveAC.Config()
    from torchtitan.config import ActivationCheckpoint  # older job config

    return (
        ActivationCheckpoint(mode="full"),
        ActivationCheckpoint(mode="selective", selective_ac_option="op"),
    )


def test_reads_torchtitans_configs():
    full, selective = _configs()
    assert tt.read_ac_config(full).mode == "full"
    got = tt.read_ac_config(selective)
    assert (got.mode, got.selective_ac_option) == ("selective", "op")
    with pytest.raises(RematUsageError):
        tt.apply_ac(S.build(), None)


def test_apply_ac_with_torchtitans_config_matches_no_ac():
    want = S.train_step(S.build(), steps=2)
    model = S.build()
    tt.apply_ac(model, _configs()[0])
    assert len(checkpointed_blocks(model)) == 4
    got = S.train_step(model, steps=2)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_override_registers_and_builds():
    if not hasattr(ac, "ActivationCheckpointing"):
        pytest.skip("this torchtitan has no override mechanism for AC")
    from torchtitan.config.override import _REGISTRY

    tt.register_torchtitan_override()
    key = "remat_dist.integrations.torchtitan.remat_activation_checkpoint"
    assert _REGISTRY[key].factory is tt.remat_activation_checkpoint
    replaced = tt.remat_activation_checkpoint(ac.FullAC.Config(), collectives="save")
    assert isinstance(replaced, ac.ActivationCheckpointing.Config)
    model = S.build()
    replaced.build(dump_folder="").apply(model)
    plan = checkpointed_blocks(model)
    assert len(plan) == 4 and plan["layers.0"].collectives == "save"


def test_override_imports_entry_replaces_the_config_node():
    # What --override.imports does: torchtitan imports the module, then replaces
    # every ActivationCheckpointing.Config node of the config tree.
    if not hasattr(ac, "ActivationCheckpointing"):
        pytest.skip("this torchtitan has no override mechanism for AC")
    from dataclasses import dataclass
    from typing import Any

    from torchtitan.config import Configurable
    from torchtitan.config.override import OverrideConfig, apply_overrides

    class Root(Configurable):
        @dataclass(kw_only=True, slots=True)
        class Config(Configurable.Config):
            activation_checkpoint: Any = None

    tt.register_torchtitan_override()
    target = "remat_dist.integrations.torchtitan.remat_activation_checkpoint"
    root = Root.Config(activation_checkpoint=ac.SelectiveAC.Config())
    lines = apply_overrides(
        OverrideConfig(imports=[(target, {"collectives": "save"})]), root
    )
    assert len(lines) == 1 and "SelectiveAC.Config -> RematDistAC.Config" in lines[0]
    replaced = root.activation_checkpoint
    assert (replaced.mode, replaced.selective_ac_option, replaced.collectives) == (
        "selective", "op", "save"
    )
    model = S.build()
    replaced.build(dump_folder="").apply(model)
    assert checkpointed_blocks(model)["layers.0"].regions == {"attention": "save"}
    # With AC off (None) there is no node to replace: the override claims nothing.
    off = Root.Config(activation_checkpoint=None)
    assert apply_overrides(OverrideConfig(imports=[target]), off) == []
