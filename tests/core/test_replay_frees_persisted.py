"""A save region's output persisted for replay is freed once the replay served it,
as torch_remat frees its output slots, not when the checkpoint's whole backward ends.

The bytes are measured without remat_dist's reports: the forward notes a weak
reference to each persisted output's storage, and a gradient hook inside the
checkpoint's backward (after its replay, before its last node) sums what is still
alive. Measured on torchtitan's DeepSeek V3 debug model under FSDP2 with fp32
parameters, holding these outputs until the block's backward ended cost 11 MiB of
peak per rank (docs/torchtitan.md).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

import remat_dist as remat

N, D = 64, 32


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(D, D, generator=g) / 6).requires_grad_()
    w2 = (torch.randn(D, D, generator=g) / 6).requires_grad_()
    return w1, w2


def _alive(refs: list[tuple[StorageWeakRef, int]]) -> int:
    return sum(n for ref, n in refs if not ref.expired())


def _watch(refs: list, t: torch.Tensor) -> None:
    if not remat.is_recomputing():
        refs.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))


def _served_block(refs: list, seen: list, w1: torch.Tensor, w2: torch.Tensor):
    """``proj`` is a save region whose output bare code reads on replay (persisted);
    ``y * 2`` saves nothing, so after the replay nothing backward needs holds it."""

    def block(x: torch.Tensor) -> torch.Tensor:
        y = remat.region(lambda t: t @ w1, "proj", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        _watch(refs, y)
        z = y * 2
        if not remat.is_recomputing():
            z.register_hook(lambda g: seen.append(_alive(refs)))
        return (z.sin() @ w2).tanh()

    return block


def _tail_block(refs: list, seen: list, w1: torch.Tensor, w2: torch.Tensor):
    """``tail`` is the last save region, its output persisted; its only save that
    replay recomputes is its input, so torch's early stop ends the replay before
    ``tail`` is served."""

    def block(x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        if not remat.is_recomputing():
            h.register_hook(lambda g: seen.append(_alive(refs)))
        y = remat.region(lambda t: t @ w1, "tail", recompute=False)(h)
        remat.recompute_needs_tensor(y)
        _watch(refs, y)
        return y * 2

    return block


def _run(make, retain: bool = False) -> tuple[int, list[int], list]:
    w1, w2 = _weights()
    refs: list = []
    seen: list[int] = []
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, D, generator=g, requires_grad=True)
    out = remat.checkpoint(region_name="blk")(make(refs, seen, w1, w2))(x)
    after_forward = _alive(refs)
    out.sum().backward(retain_graph=retain)
    return after_forward, seen, [x, w1, w2, out]


def test_served_output_is_freed_after_replay():
    after_forward, seen, _ = _run(_served_block)
    assert after_forward == N * D * 4  # persisted for the replay
    assert seen == [0]  # before the fix: [8192], held until the block's backward ended


def test_output_after_early_stop_is_freed():
    after_forward, seen, _ = _run(_tail_block)
    assert after_forward == N * D * 4
    assert seen == [0]  # never served: dropped when the replay stopped


def test_retain_graph_keeps_them_for_the_next_backward():
    after_forward, seen, (x, w1, w2, out) = _run(_served_block, retain=True)
    assert seen == [N * D * 4]  # a later backward replays again and reads them
    grads = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None
    out.sum().backward()
    assert seen == [N * D * 4, 0]
    for t, g in zip((x, w1, w2), grads):
        torch.testing.assert_close(t.grad, g)
