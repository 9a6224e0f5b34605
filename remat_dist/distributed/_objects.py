"""Python objects across ranks, without numpy.

torch's ``gather_object`` / ``all_gather_object`` turn pickles into tensors through
numpy, which a plain ``pip install remat-dist`` does not bring: they raise "Numpy is
not available". Reports, the launcher and the test harness gather small objects
(summaries, peak memory) once per run, so this sends the pickle as a byte tensor with
two ``all_gather`` calls instead: lengths, then the padded bytes. The tensors live
where the group's backend wants them: the CPU for gloo, this rank's device
(:func:`rank_device`) for NCCL.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from remat_dist.distributed._rank_device import rank_device

__all__ = ["all_gather_objects"]


def _device(group: Any) -> torch.device:
    import torch.distributed as dist

    try:
        backend = str(dist.get_backend(group)).lower()
    except Exception:
        return torch.device("cpu")
    if "nccl" in backend:
        pg = group if group is not None else dist.group.WORLD
        bound = getattr(pg, "bound_device_id", None)
        return bound if bound is not None else rank_device()
    return torch.device("cpu")


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), indexed by group rank. A collective: call
    it on every rank of ``group`` (default: the world)."""
    import torch.distributed as dist

    device = _device(group)
    data = pickle.dumps(obj)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    n = dist.get_world_size(group)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    out = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(out, padded, group=group)
    return [pickle.loads(bytes(t[:k].cpu().tolist())) for t, k in zip(out, lengths)]
