"""remat_dist.integrations.torchtitan on a torchtitan-shaped stand-in model.

Every comparison is against the same model trained without activation
checkpointing: equal loss and gradients (bitwise, CPU), and equal MoE token counts.
"""

from __future__ import annotations

import ast
import functools
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from remat_dist import RematUsageError, apply_remat
from remat_dist.integrations import torchtitan as tt
from remat_dist.integrations.torchtitan import _override as tt_override
from remat_dist.integrations.torchtitan._config import SETTINGS_ATTR
from remat_dist.wrap import checkpointed_blocks
from tests.integrations import _standin as S

ALL = ["layers.0", "layers.1", "layers.2", "layers.3"]


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return S.train_step(S.build(), steps=2)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, different


@pytest.mark.parametrize(
    "config, blocks, regions",
    [
        (S.JobACConfig(mode="full"), ALL, {}),
        (S.FullAC.Config(), ALL, {}),
        (
            S.JobACConfig(mode="selective", selective_ac_option="2"),
            ["layers.1", "layers.3"],
            {},
        ),
        (S.JobACConfig(mode="selective", selective_ac_option="3"), ["layers.2"], {}),
        (S.JobACConfig(mode="selective", selective_ac_option="0"), ALL, {}),
        (
            S.JobACConfig(mode="selective", selective_ac_option="op"),
            ALL,
            {"attention": "save"},
        ),
        (S.SelectiveAC.Config(), ALL, {"attention": "save"}),
    ],
    ids=[
        "job-full",
        "FullAC",
        "layer-2",
        "layer-3",
        "layer-0",
        "job-op",
        "SelectiveAC",
    ],
)
def test_right_blocks_and_same_training_as_without_ac(
    config, blocks, regions, reference
):
    model = S.build()
    assert tt.selected_blocks(model, config) == blocks
    assert tt.apply_ac(model, config) is model
    plan = checkpointed_blocks(model)
    assert list(plan) == blocks
    assert all(spec.regions == regions for spec in plan.values())
    # preserve_rng_state=True -> remat_dist's default RNG hooks (dropout replays)
    assert all(spec.state_hooks is None for spec in plan.values())
    for name in blocks:
        assert model.get_submodule(name).__dict__[SETTINGS_ATTR].mode in (
            "full",
            "selective",
        )
    # loss, every gradient and the MoE token counts equal the run without AC
    _assert_same(S.train_step(model, steps=2), reference)


def test_moe_token_counts_are_not_doubled(reference):
    # Control: plain apply_remat recomputes the MoE forward, which counts again.
    plain = S.build()
    apply_remat(plain, blocks=ALL, policy="full")
    doubled = S.train_step(plain, steps=2)
    counts = [k for k in reference if k.startswith("count:")]
    assert counts == ["count:layers.1.moe", "count:layers.3.moe"]
    for k in counts:
        assert reference[k].sum() == 2 * 2 * 8 * S.TOP_K  # 2 steps x 16 tokens x top-2
        assert torch.equal(doubled[k], 2 * reference[k])
    # The adapter guards the counters: counts equal the run without AC, and it does
    # not mark blocks as torch's CheckpointWrapper (torchtitan would halve them).
    model = S.build()
    tt.apply_ac(model, S.JobACConfig(mode="full"))
    assert tt.guarded_counters(model) == ["layers.1.moe", "layers.3.moe"]
    got = S.train_step(model, steps=2)
    for k in counts:
        assert torch.equal(got[k], reference[k])
    for block in model.layers.values():
        assert getattr(block, "checkpoint_impl", None) is None


def test_counts_right_when_the_moe_is_a_save_region(reference):
    # A saved MoE is not replayed: halving would be wrong, the guard is a no-op.
    model = S.build()
    config = S.JobACConfig(mode="selective", selective_ac_option="op")
    tt.apply_ac(
        model,
        config,
        op_policy=lambda name, m: {"moe": "save"} if m.moe_enabled else "full",
    )
    assert checkpointed_blocks(model)["layers.1"].regions == {"moe": "save"}
    assert checkpointed_blocks(model)["layers.0"].regions == {}
    _assert_same(S.train_step(model, steps=2), reference)


@pytest.mark.parametrize(
    "config, words",
    [
        (None, "activation checkpointing is off"),
        (S.JobACConfig(mode="none"), "activation checkpointing is off"),
        ("none", "activation checkpointing is off"),
        (S.MemoryBudgetAC.Config(), "memory_budget"),
        (S.JobACConfig(mode="memory_budget"), "memory_budget"),
        (
            S.JobACConfig(mode="selective", selective_ac_option="5"),
            "selects none of the 4 blocks",
        ),
        (
            S.JobACConfig(mode="selective", selective_ac_option="every"),
            "neither 'op' nor",
        ),
        (S.JobACConfig(mode="sometimes"), "unknown activation-checkpoint mode"),
        (object(), "cannot read"),
    ],
)
def test_refuses_when_it_would_apply_nothing(config, words):
    model = S.build()
    with pytest.raises(RematUsageError, match=words):
        tt.apply_ac(model, config)
    assert checkpointed_blocks(model) == {}
    assert tt.guarded_counters(model) == []
    assert "_remat_dist_step_hook" not in model.__dict__


def test_refuses_a_model_without_layers():
    with pytest.raises(RematUsageError, match="has no 'layers' submodule"):
        tt.apply_ac(torch.nn.Linear(2, 2), "full")


def test_a_pipeline_stage_without_blocks_is_left_alone(caplog):
    # a stage holding only the output: nothing to checkpoint, as torchtitan says
    stage = torch.nn.Module()
    stage.layers = torch.nn.ModuleDict()
    stage.output = torch.nn.Linear(2, 2)
    with caplog.at_level("INFO", logger="remat_dist"):
        assert tt.apply_ac(stage, "full") is stage
    assert checkpointed_blocks(stage) == {}
    assert "no transformer blocks in this model part" in caplog.text


def test_knobs_map_onto_apply_remat():
    model = S.build()
    config = S.JobACConfig(
        mode="full", preserve_rng_state=False, determinism_check="none", debug=True
    )
    with pytest.warns(UserWarning) as caught:
        tt.apply_ac(model, config, collectives="save")
    texts = [str(w.message) for w in caught]
    assert any("debug" in t for t in texts), texts
    assert not any("with dropout" in t for t in texts), texts  # no nn.Dropout here
    spec = checkpointed_blocks(model)["layers.0"]
    assert spec.state_hooks == ()
    assert spec.collectives == "save"
    settings = tt.read_ac_config(config)
    assert (settings.determinism_check, settings.preserve_rng_state) == ("none", False)
    # a built policy (anything with .config) is read through its config
    policy = types.SimpleNamespace(
        config=S.SelectiveAC.Config(preserve_rng_state=False)
    )
    assert tt.read_ac_config(policy) == tt.ACSettings(
        mode="selective", selective_ac_option="op", preserve_rng_state=False
    )


def test_preserve_rng_state_false_with_dropout_modules_warns():
    """torchtitan's preserve_rng_state=False drops the RNG hooks (as torchtitan's
    own AC does): with an nn.Dropout in a checkpointed block the replay draws other
    masks, and the warning names the module and the fix."""
    model = S.build()
    model.layers["1"].drop = torch.nn.Dropout(0.1)
    with pytest.warns(
        UserWarning,
        match=r"with dropout in the checkpointed blocks "
        r"\(layers\.1\.drop\).*Fix: preserve_rng_state=True",
    ):
        tt.apply_ac(model, S.JobACConfig(mode="full", preserve_rng_state=False))


def test_remove_ac_restores_the_model(reference):
    model = S.build()
    tt.apply_ac(model, S.JobACConfig(mode="full"))
    tt.remove_ac(model)
    assert checkpointed_blocks(model) == {} and tt.guarded_counters(model) == []
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(SETTINGS_ATTR not in m.__dict__ for m in model.modules())
    _assert_same(S.train_step(model, steps=2), reference)


def test_imports_torchtitan_only_inside_functions():
    top = [
        node
        for path in Path(tt.__file__).parent.glob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, (ast.Import, ast.ImportFrom))
    ]
    names = [a.name for n in top for a in n.names] + [
        n.module for n in top if isinstance(n, ast.ImportFrom) and n.module
    ]
    assert not [n for n in names if n.split(".")[0] == "torchtitan"]
    assert (
        "torchtitan" not in sys.modules or "torchtitan.config.override" in sys.modules
    )


# --- the override wiring, against a minimal fake of torchtitan's registry -------------


def _fake_torchtitan(monkeypatch: pytest.MonkeyPatch) -> dict:
    registry: dict = {}

    class Configurable:
        @dataclass(kw_only=True, slots=True)
        class Config:
            def build(self, **kwargs):
                return self._owner(config=self, **kwargs)

        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__(**kwargs)
            if "Config" in cls.__dict__:
                cls.Config._owner = cls

    class ActivationCheckpointing(Configurable):
        @dataclass(kw_only=True, slots=True)
        class Config(Configurable.Config):
            preserve_rng_state: bool = True
            determinism_check: str = "default"
            debug: bool = False

        def __init__(self, config, dump_folder: str = ""):
            self.config = config

    def override(*, target, fqns=None, description="", exact=False):
        def decorator(fn):
            key = f"{fn.__module__}.{fn.__name__}"
            if key in registry:
                raise ValueError(f"Override '{key}' is already registered")
            registry[key] = (target, fn)
            return fn

        return decorator

    ac_module = types.ModuleType("torchtitan.distributed.activation_checkpoint")
    ac_module.ActivationCheckpointing = ActivationCheckpointing
    override_module = types.ModuleType("torchtitan.config.override")
    override_module.override = override
    for name, module in {
        "torchtitan": types.ModuleType("torchtitan"),
        "torchtitan.config": types.ModuleType("torchtitan.config"),
        "torchtitan.config.override": override_module,
        "torchtitan.distributed": types.ModuleType("torchtitan.distributed"),
        "torchtitan.distributed.activation_checkpoint": ac_module,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    # a fresh cache for this test's fake torchtitan, the real one put back after it
    fresh = functools.cache(tt_override._remat_ac_config_class.__wrapped__)
    monkeypatch.setattr(tt_override, "_remat_ac_config_class", fresh)
    return registry


def test_override_factory_replaces_torchtitans_ac(monkeypatch, reference):
    if "torchtitan" in sys.modules:
        pytest.skip("a real torchtitan is imported")
    registry = _fake_torchtitan(monkeypatch)
    assert tt.register_torchtitan_override() is True
    assert tt.register_torchtitan_override() is False
    key = "remat_dist.integrations.torchtitan.remat_activation_checkpoint"
    assert registry[key][1] is tt.remat_activation_checkpoint
    replaced = tt.remat_activation_checkpoint(S.FullAC.Config(), collectives="save")
    assert (replaced.mode, replaced.collectives) == ("full", "save")
    model = S.build()
    replaced.build(dump_folder="").apply(model)
    assert list(checkpointed_blocks(model)) == ALL
    assert checkpointed_blocks(model)["layers.0"].collectives == "save"
    _assert_same(S.train_step(model, steps=2), reference)
    with pytest.raises(RematUsageError, match="memory_budget"):
        tt.remat_activation_checkpoint(S.MemoryBudgetAC.Config())


def test_patch_apply_ac_replaces_a_parallelize_modules_apply_ac(reference):
    calls = []
    parallelize = types.SimpleNamespace(apply_ac=lambda *a, **k: calls.append(a))
    original = parallelize.apply_ac
    tt.patch_apply_ac(parallelize, collectives="save")
    tt.patch_apply_ac(parallelize, collectives="save")  # twice: still one layer
    assert parallelize.apply_ac.torchtitan is original
    model = S.build()
    # torchtitan's call shape, with its extra keyword arguments
    parallelize.apply_ac(
        model,
        S.JobACConfig(mode="full"),
        model_compile_enabled=False,
        use_flex_attn=False,
        op_sac_save_list=set(),
        base_folder="",
    )
    assert calls == [] and list(checkpointed_blocks(model)) == ALL
    assert checkpointed_blocks(model)["layers.0"].collectives == "save"
    _assert_same(S.train_step(model, steps=2), reference)
    with pytest.raises(RematUsageError, match="has no apply_ac"):
        tt.patch_apply_ac(types.SimpleNamespace())
