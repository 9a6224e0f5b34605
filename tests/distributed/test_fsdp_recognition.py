"""FSDP2's own collectives are recognised through FSDP2 itself (its parameter
group's ``unshard`` and ``post_backward``, wrapped by ``remat_dist/_torch/_fsdp.py``),
not by reading stack frames."""

from __future__ import annotations

import torch
import torch.distributed as dist

from remat_dist._torch import _fsdp
from remat_dist.distributed._intercept import issued_by_fsdp, observe_collectives
from remat_dist.testing import distributed


class _Marks:
    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []

    def on_collective(self, call, issue):
        self.seen.append((call.op, issued_by_fsdp()))
        return issue()


@distributed(world_size=2)
def test_fsdp2_collectives_are_recognised_and_others_are_not(ctx):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)
    )
    fully_shard(m[0])
    fully_shard(m)
    marks = _Marks()
    with observe_collectives(marks):
        out = m(torch.randn(3, 8))
        dist.all_reduce(torch.ones(1))  # the user's own, between FSDP2's
        out.sum().backward()
    fsdp = [op for op, mine in marks.seen if mine]
    other = [op for op, mine in marks.seen if not mine]
    assert other == ["allreduce_"]
    assert "_allgather_base_" in fsdp and "_reduce_scatter_base_" in fsdp
    assert not _fsdp.inside_fsdp()


def test_tracking_wraps_once_and_counts_per_thread():
    assert _fsdp.track_fsdp_collectives()
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    wrapped = {n: FSDPParamGroup.__dict__[n] for n in _fsdp.FSDP_METHODS}
    assert _fsdp.track_fsdp_collectives()
    assert wrapped == {n: FSDPParamGroup.__dict__[n] for n in _fsdp.FSDP_METHODS}
    assert not _fsdp.inside_fsdp()
