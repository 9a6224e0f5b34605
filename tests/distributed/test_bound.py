"""The replay bound applies to what remat_dist issues and to nothing else.

``set_replay_timeout`` bounds remat_dist's own rounds (the plan agreement, the
end-of-backward report) and each collective a replay re-issues. Every other
collective of the step (FSDP2's, a DDP-style gradient all-reduce in a hook, a
pipeline's send/recv) keeps its process group's timeout: a rank that is slow
there is waited for exactly as torch alone waits for it. Real gloo ranks.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import remat_dist as remat
from remat_dist.distributed import _intercept
from remat_dist.distributed._optable import _group_info
from remat_dist.models import GPT, Block, GPTConfig, make_batch
from remat_dist.testing import DistContext, dist_context, distributed, run_distributed

CONFIG = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=2)
BOUND_S = 1.0


def _model(mesh, policy):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if policy is not None:
        remat.apply_remat(model, blocks=Block, policy=policy)
    remat.shard_model(model, mesh, blocks=Block, tp_plan=remat.shard.reference_tp_plan())
    return model


def _local(t):
    return getattr(t, "_local_tensor", t)


def _slow_gradient_all_reduce(policy, slow_s):
    """TP=2 with a DDP-style all-reduce over the world in a hook at the end of
    backward (the embedding's gradient, the last one computed), rank 1 slow
    there by ``slow_s``: the seconds backward took and the gradients."""
    ctx = dist_context()
    remat.distributed.set_replay_timeout(BOUND_S)
    try:
        model = _model(ctx.mesh["tp"], policy)
        reduced = torch.ones(3)

        def reduce(p):
            if ctx.rank == 1:
                time.sleep(slow_s)
            dist.all_reduce(reduced)

        model.tok_emb.weight.register_post_accumulate_grad_hook(reduce)
        tokens, targets = make_batch(CONFIG, 4, seed=3)
        loss = model.loss(tokens, targets)
        t0 = time.perf_counter()
        loss.backward()
        elapsed = time.perf_counter() - t0
        grads = {n: _local(p.grad).clone() for n, p in model.named_parameters()}
        return elapsed, grads, reduced
    finally:
        remat.distributed.set_replay_timeout(None)


def test_a_slow_rank_outside_replays_is_waited_for_as_torch_waits():
    # rank 1 is 2.5 bounds late to an all-reduce remat_dist does not issue: with
    # remat_dist as without it, both ranks wait and finish; nothing raises
    kwargs = dict(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
    plain = run_distributed(_slow_gradient_all_reduce, None, 2.5 * BOUND_S, **kwargs)
    remat_run = run_distributed(_slow_gradient_all_reduce, "full", 2.5 * BOUND_S, **kwargs)
    for rank in (0, 1):
        elapsed, grads, reduced = remat_run[rank]
        assert elapsed >= 2.5 * BOUND_S, elapsed  # it waited, as torch does
        _, ref_grads, ref_reduced = plain[rank]
        assert torch.equal(reduced, ref_reduced)
        assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


class _Timeouts:
    """Every collective remat_dist's interception issues on this rank, with the
    timeout argument it carries (None: the op has none) and whether a replay
    issued it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, tuple[int, ...], int | None, bool]] = []
        specs = _intercept._INSTALLED.specs.values()
        self.by_handle = {id(s.overload._handle): s for s in specs}

    def __call__(self, redispatch, keyset, args):
        spec = self.by_handle.get(id(getattr(redispatch, "__self__", None)))
        if spec is not None and torch._C._current_graph_task_id() != -1:
            i = spec.timeout_idx
            timeout = None
            if i is not None:
                timeout = args[i] if i < len(args) else spec.defaults[i]
            ranks = _group_info(args[spec.group_idx]).ranks
            self.seen.append((spec.name, ranks, timeout, remat.is_recomputing()))
        return self.issue(redispatch, keyset, args)


@distributed(world_size=4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
def test_fsdp2_x_tp_backward_collectives_carry_their_own_timeouts(ctx: DistContext):
    # FSDP2 on "dp" x TP on "tp", remat on every block: in backward, each
    # collective a replay re-issues carries the bound; FSDP2's reduce-scatters
    # and all-gathers (and TP's own backward collectives) carry what they came
    # with: their group's timeout, untouched
    model = GPT(CONFIG)
    remat.apply_remat(model, blocks=Block, policy="full")
    remat.shard_model(model, ctx.mesh, blocks=Block, tp_plan=remat.shard.reference_tp_plan())
    tokens, targets = make_batch(CONFIG, 4, seed=3)
    model.loss(tokens, targets).backward()  # the first step sets the rounds up
    probe = _Timeouts()
    probe.issue = _intercept._issue_bare
    remat.distributed.set_replay_timeout(7.0)
    _intercept._issue_bare = probe
    try:
        model.zero_grad()
        model.loss(tokens, targets).backward()
    finally:
        _intercept._issue_bare = probe.issue
        remat.distributed.set_replay_timeout(None)
    tp = tuple(dist.get_process_group_ranks(ctx.mesh["tp"].get_group()))
    dp = tuple(dist.get_process_group_ranks(ctx.mesh["dp"].get_group()))
    replayed = [s for s in probe.seen if s[3]]
    others = [s for s in probe.seen if not s[3]]
    assert replayed and others, probe.seen
    assert all(r[1] == tp and r[2] == 7000 for r in replayed), replayed
    fsdp = [s for s in others if s[1] == dp]
    assert any("reduce_scatter" in s[0] for s in fsdp), others
    untouched = {s[2] for s in others}
    assert 7000 not in untouched, others


def _stall_before_a_replayed_collective(seconds):
    """Rank 1 stalls in its replay before the attention's all-reduce, which rank
    0's replay re-issues and waits for: the bound ends that wait."""
    ctx = dist_context()
    remat.distributed.set_replay_timeout(seconds)
    try:
        model = _model(ctx.mesh["tp"], "full")
        if ctx.rank == 1:

            def stall(module, args):
                if remat.is_recomputing():
                    time.sleep(seconds * 3)

            model.layers[1].attention.register_forward_pre_hook(stall)
        tokens, targets = make_batch(CONFIG, 4, seed=3)
        loss = model.loss(tokens, targets)
        t0 = time.perf_counter()
        try:
            loss.backward()
            outcome = "no error"
        except Exception as exc:  # noqa: BLE001 - recorded for the parent
            outcome = f"{type(exc).__name__}: {exc}"
        return time.perf_counter() - t0, outcome
    finally:
        remat.distributed.set_replay_timeout(None)
        # a timed-out collective leaves gloo's pairs out of step: retire the group
        dist.destroy_process_group()


def test_a_stall_before_a_replayed_collective_raises_at_the_bound():
    rank0, rank1 = run_distributed(
        _stall_before_a_replayed_collective,
        BOUND_S,
        world_size=2,
        mesh_shape=(2,),
        mesh_dim_names=("tp",),
    )
    elapsed, outcome = rank0
    # the replayed all-reduce carried the bound: gloo's wait ends at 1000 ms
    assert "1000ms" in outcome or "did not join it in time" in outcome, outcome
    assert elapsed < 3 * BOUND_S + 2.0, (elapsed, outcome)
    assert rank1[1] != "no error", rank1


def test_none_restores_the_default_bound():
    from remat_dist.distributed._step import replay_timeout

    remat.distributed.set_replay_timeout(2.0)
    assert replay_timeout() == 2.0
    remat.distributed.set_replay_timeout(None)
    assert replay_timeout() == 300.0
