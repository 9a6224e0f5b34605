"""apply_remat in one process: policies, structure kept, misuse refused, the
equivalence helper (and that it catches a real difference)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat_dist as remat
from remat_dist import RematUsageError, apply_remat, remove_remat
from remat_dist.models import GPT, MLP, Attention, Block, GPTConfig, make_batch
from remat_dist.testing.equivalence import assert_remat_equivalent
from remat_dist.wrap import checkpointed_blocks
from tests.wrap._rng import cpu_hooks

CFG = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=2, dropout=0.1)
BATCH = make_batch(CFG, 2, seed=0)


def gpt_loss(model: nn.Module, batch) -> torch.Tensor:
    return model.loss(*batch)


def count_calls(model: nn.Module) -> dict[str, int]:
    """Count every call of each block's attention and mlp (replays included)."""
    counts = {"attention": 0, "mlp": 0}
    for module in model.modules():
        for kind, cls in (("attention", Attention), ("mlp", MLP)):
            if isinstance(module, cls):
                module.register_forward_pre_hook(
                    lambda *_, k=kind: counts.__setitem__(k, counts[k] + 1)
                )
    return counts


@pytest.mark.parametrize(
    "policy",
    ["full", {"attention": "save"}, {"mlp": "save", "attention": "recompute"}, 2],
    ids=["full", "attention-saved", "mlp-saved", "every-2"],
)
def test_equivalent_with_dropout(policy):
    report = assert_remat_equivalent(
        lambda: GPT(CFG),
        BATCH,
        blocks=Block,
        policy=policy,
        steps=3,
        loss_fn=gpt_loss,
        recompute_state_hooks=cpu_hooks(),
        make_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    expected = ["layers.0"] if policy == 2 else ["layers.0", "layers.1"]
    assert report.checkpointed == expected
    assert report.max_grad_diff == 0.0 and report.max_param_diff == 0.0


def test_helper_catches_unrestored_rng():
    # No state hooks: replay draws other dropout masks, so gradients differ.
    with pytest.raises(AssertionError, match="remat changed training"):
        assert_remat_equivalent(
            lambda: GPT(CFG), BATCH, blocks=Block, loss_fn=gpt_loss, recompute_state_hooks=()
        )


def test_recomputes_what_the_policy_says():
    calls = {}
    for name, policy in (
        ("none", None),
        ("full", "full"),
        ("attn", {"attention": "save"}),
    ):
        torch.manual_seed(0)
        model = GPT(CFG)
        if policy is not None:
            apply_remat(model, blocks=Block, policy=policy, recompute_state_hooks=cpu_hooks())
        counts = count_calls(model)
        model.loss(*BATCH).backward()
        calls[name] = dict(counts)
    assert calls["none"] == {"attention": 2, "mlp": 2}
    assert calls["full"] == {"attention": 4, "mlp": 4}  # both replayed
    # The saved attention is not replayed, its own hooks included (the region
    # covers the whole module call).
    assert calls["attn"] == {"attention": 2, "mlp": 4}


def test_structure_and_names_unchanged():
    plain = GPT(CFG)
    model = GPT(CFG)
    types_before = [(n, type(m)) for n, m in model.named_modules()]
    apply_remat(model, blocks=Block, policy={"attention": "save"})
    assert [(n, type(m)) for n, m in model.named_modules()] == types_before
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_parameters()] == [
        n for n, _ in plain.named_parameters()
    ]
    model.load_state_dict(plain.state_dict())  # keys load as they are
    plan = checkpointed_blocks(model)
    assert list(plan) == ["layers.0", "layers.1"]
    assert plan["layers.0"].regions == {"attention": "save"}


def test_apply_twice_names_the_block():
    model = GPT(CFG)
    apply_remat(model, blocks=["layers.1"])
    with pytest.raises(
        RematUsageError, match=r"block 'layers.1' is already checkpointed"
    ):
        apply_remat(model, blocks=Block)
    assert list(checkpointed_blocks(model)) == ["layers.1"]  # the failed call changed nothing


def test_remove_remat_restores_and_allows_reapply():
    model = GPT(CFG)
    apply_remat(model, blocks=Block, policy={"attention": "save"})
    remove_remat(model)
    assert checkpointed_blocks(model) == {}
    assert all(
        "forward" not in m.__dict__ and "_call_impl" not in m.__dict__
        for m in model.modules()
    )
    apply_remat(model, blocks=Block, policy="full")
    assert list(checkpointed_blocks(model)) == ["layers.0", "layers.1"]


def test_selectors():
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=4))
    apply_remat(
        model, blocks=lambda name, m: isinstance(m, Block) and name.endswith(("1", "3"))
    )
    assert list(checkpointed_blocks(model)) == ["layers.1", "layers.3"]
    remove_remat(model)
    apply_remat(model, blocks=Block, policy={"every": 3, "mlp": "save"})
    assert {n: p.regions for n, p in checkpointed_blocks(model).items()} == {
        "layers.0": {"mlp": "save"},
        "layers.3": {"mlp": "save"},
    }
    remove_remat(model)
    apply_remat(
        model,
        blocks=Block,
        policy=lambda name, m: "none" if name == "layers.0" else {"attention": "save"},
    )
    assert list(checkpointed_blocks(model)) == ["layers.1", "layers.2", "layers.3"]


def test_misuse_is_refused():
    model = GPT(CFG)
    with pytest.raises(RematUsageError, match=r"no submodule 'layer.0'.*'layers.0'"):
        apply_remat(model, blocks=["layer.0"])
    with pytest.raises(
        RematUsageError, match="no submodule 'attn' named in the policy"
    ):
        apply_remat(model, blocks=Block, policy={"attn": "save"})
    with pytest.raises(RematUsageError, match="expected one of"):
        apply_remat(model, blocks=Block, policy={"attention": "keep"})
    with pytest.raises(RematUsageError, match="inside save region 'attention'"):
        apply_remat(
            model, blocks=Block, policy={"attention": "save", "attention.wq": "save"}
        )
    with pytest.raises(RematUsageError, match="nested checkpoints"):
        apply_remat(model, blocks=["layers", "layers.0"])
    with pytest.raises(RematUsageError, match="no submodule of GPT matches"):
        apply_remat(model, blocks=nn.Conv2d)
    with pytest.raises(RematUsageError, match="collectives"):
        apply_remat(model, blocks=Block, collectives="sometimes")
    assert checkpointed_blocks(model) == {}


def test_deepcopy_rebinds_to_the_copy():
    model = GPT(CFG)
    apply_remat(
        model, blocks=Block, policy={"attention": "save"}, recompute_state_hooks=cpu_hooks()
    )
    clone = copy.deepcopy(model)
    assert clone.layers[0].forward.__self__ is clone.layers[0]
    attention = clone.layers[0].attention
    assert attention.__dict__["_call_impl"].__self__ is attention
    torch.manual_seed(0)
    clone.loss(*BATCH).backward()
    assert all(p.grad is not None for p in clone.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_the_never_released_aliases_are_gone():
    # state_hooks= (apply_remat), collectives="verify" and verify_plan= were
    # deprecated in a version that was never released: they are refused now
    with pytest.raises(TypeError, match="state_hooks"):
        apply_remat(GPT(CFG), blocks=Block, state_hooks=())
    with pytest.raises(RematUsageError, match="collectives must be one of"):
        remat.checkpoint(region_name="old", collectives="verify")
    with pytest.raises(RematUsageError, match="unsupported option"):
        remat.checkpoint(region_name="old", verify_plan=True)




def test_remat_plan_is_checkpointed_blocks_under_its_old_name():
    import remat_dist.wrap

    with pytest.warns(DeprecationWarning, match="remat_dist.wrap.checkpointed_blocks"):
        old = remat_dist.wrap.remat_plan
    assert old is checkpointed_blocks
