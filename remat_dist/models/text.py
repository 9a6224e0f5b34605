"""The tiny bundled text corpus, byte level, for the launcher's demo runs.

No download at run time: the text ships with the package. Bytes are the tokens
(``vocab_size=256``), so the loss falls visibly within a few dozen steps.
"""

from __future__ import annotations

from importlib import resources

import torch

__all__ = ["TEXT_VOCAB_SIZE", "load_tiny_corpus", "text_batch"]

TEXT_VOCAB_SIZE = 256
"""Byte-level tokens."""


def load_tiny_corpus() -> torch.Tensor:
    """The bundled corpus as an int64 tensor of byte values."""
    raw = (resources.files("remat_dist.models") / "data" / "tiny_corpus.txt").read_bytes()
    return torch.tensor(list(raw), dtype=torch.int64)


def text_batch(
    corpus: torch.Tensor, batch_size: int, seq_len: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``corpus``: ``(tokens, targets)`` of shape
    ``(batch_size, seq_len)``, targets shifted by one. Deterministic in ``seed``
    and independent of the global RNG."""
    if corpus.numel() <= seq_len + 1:
        raise ValueError(f"corpus of {corpus.numel()} tokens is too short for seq_len {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    windows = corpus[idx]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
