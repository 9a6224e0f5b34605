"""``remat_dist.testing.PeakSavedBytes``: per forward, and over whole steps
(``whole_step=True``: the loss included)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat_dist as remat
from remat_dist.testing import PeakSavedBytes, SavedBytesCounter

VOCAB = 4096  # the loss saves far more than the model's forward


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_Block(), _Block())
        self.head = nn.Linear(16, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _counted(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """What the forward saves, and what the loss saves after it, each counted
    alone by SavedBytesCounter."""
    with SavedBytesCounter(model.parameters()) as fwd:
        logits = model(x)
    with SavedBytesCounter(model.parameters()) as loss:
        F.cross_entropy(logits, y)
    return fwd.activation_bytes, loss.activation_bytes


@pytest.mark.parametrize("remat_blocks", [False, True])
def test_whole_step_counts_the_loss(remat_blocks):
    """Over a whole step the peak is the forward's bytes plus the loss's (a
    cross-entropy over a vocabulary 256x the hidden size), the forward peak the
    forward's alone, without checkpoints and with the blocks checkpointed; the
    meter ends each step with nothing alive. Per forward (the default) the loss
    is left out."""
    torch.manual_seed(0)
    model = _Net()
    if remat_blocks:
        remat.apply_remat(model, blocks=_Block, policy="full")
    x, y = torch.randn(8, 16, requires_grad=True), torch.randint(0, VOCAB, (8,))
    fwd, loss = _counted(model, x, y)
    assert loss > 4 * fwd  # the loss is what matters here

    step = PeakSavedBytes(model, whole_step=True)
    for _ in range(2):  # the second step starts from nothing alive
        step.reset()
        with step:
            F.cross_entropy(model(x), y).backward()
        assert (step.peak, step.forward_peak) == (fwd + loss, fwd)
        assert step.total == 0 and step.live == {}

    per_forward = PeakSavedBytes(model)
    F.cross_entropy(model(x), y).backward()
    assert (per_forward.peak, per_forward.forward_peak) == (fwd, fwd)


def test_entered_without_whole_step_names_the_fix():
    meter = PeakSavedBytes(_Net())
    with pytest.raises(remat.RematUsageError, match=r"whole_step=True"):
        with meter:
            pass
