"""``memory_snapshot_annotate``: label saved tensors with their allocation site.

The CUDA caching allocator records, while memory-history recording is on
(``torch.cuda.memory._record_memory_history()``), a backtrace for every block it
hands out. A saved tensor's storage pointer falls inside exactly one live block,
so the snapshot tells which line of model code allocated it: the label a row in
the saved-tensors report otherwise lacks.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

from remat_dist._torch._cuda import memory_snapshot
from remat_dist.report._accounting import Annotate

__all__ = ["allocation_site", "clear_memory_snapshot_cache", "memory_snapshot_annotate"]

_INTERNAL = ("/torch/", "/remat_dist/", "<frozen ", "/site-packages/torch")


def allocation_site(frames: Sequence[Mapping[str, Any]] | None) -> str | None:
    """``file.py:12 fn`` for the innermost frame of user code in a backtrace.

    Frames are innermost first (the snapshot's order). Frames inside torch and
    remat_dist are skipped; when nothing else is left, the innermost frame is used.
    """
    if not frames:
        return None
    chosen = next(
        (
            f
            for f in frames
            if not any(s in str(f.get("filename", "")) for s in _INTERNAL)
        ),
        frames[0],
    )
    filename = str(chosen.get("filename", "?")).replace("\\", "/").split("/")[-1]
    name = chosen.get("name")
    site = f"{filename}:{chosen.get('line', '?')}"
    return f"{site} {name}" if name else site


def memory_snapshot_annotate(snapshot: Mapping[str, Any] | None = None) -> Annotate:
    """An ``annotate=`` callable for the reports: tensor -> allocation site.

    Args:
        snapshot: a CUDA memory snapshot (``torch.cuda.memory._snapshot()``); taken
            now when omitted (one snapshot per call: build the annotator once per
            report). Needs CUDA when omitted.

    The returned callable gives None for tensors it cannot place (CPU tensors,
    blocks recorded without frames, memory allocated before recording started).

    Returns:
        The ``tensor -> str | None`` callable.

    Example::

        >>> torch.cuda.memory._record_memory_history(max_entries=100_000)
        >>> loss = model(x).sum()
        >>> remat_dist.print_saved_tensors_report(
        ...     loss, annotate=remat_dist.memory_snapshot_annotate())
    """
    if snapshot is None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "memory_snapshot_annotate() needs CUDA (it reads the CUDA caching "
                "allocator's snapshot); pass snapshot= to use a saved one"
            )
        snapshot = memory_snapshot()
    index: dict[int, tuple[list[int], list[tuple[int, int, str]]]] = {}
    for segment in snapshot.get("segments", ()):
        device = int(segment.get("device", 0))
        starts, blocks = index.setdefault(device, ([], []))
        address = int(segment.get("address", 0))
        for block in segment.get("blocks", ()):
            size = int(block.get("size", 0))
            block_address = int(block.get("address", address))
            address = block_address + size
            if block.get("state") != "active_allocated":
                continue
            site = allocation_site(block.get("frames"))
            if site is not None:
                blocks.append((block_address, size, site))
    for starts, blocks in index.values():
        blocks.sort()
        starts[:] = [b[0] for b in blocks]

    def annotate(tensor: Any) -> str | None:
        device = tensor.device
        if getattr(device, "type", None) != "cuda":
            return None
        found = index.get(device.index or 0)
        if found is None:
            return None
        starts, blocks = found
        ptr = tensor.untyped_storage().data_ptr()
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0:
            start, size, site = blocks[i]
            if start <= ptr < start + size:
                return site
        return None

    return annotate


def clear_memory_snapshot_cache() -> None:
    """torch_remat's name, kept so that code switching imports runs unchanged.

    remat_dist keeps no snapshot between calls: each :func:`memory_snapshot_annotate`
    call without ``snapshot=`` takes a fresh one, so there is nothing to clear.

    Returns:
        None.

    Example::

        >>> remat_dist.clear_memory_snapshot_cache()  # does nothing, as documented
    """
