"""``format_current_memory_report``: what the running checkpoint holds right now.

Call it from inside a checkpointed function on forward (guard it with
``if not remat_dist.is_recomputing():``) to see, per save region so far, the
storages kept for backward, named by ``save_for_backward`` names where given, each
storage counted once however many views of it were saved::

    layers.0: 28 B resident in 2 storage(s)
    layers.0::attn.softmax: 28 B
      12 B  lse    (3,)  float32
      16 B  probs  (4,)  float32
    layers.0 inputs: 48 B in 1 storage (kept so that replay can start)
      48 B  x  (3, 4)  float32

Under ``collectives="save"`` the collective outputs kept so far for comm-free
replay are one more region, ``<name>::kept``, each row labelled ``... output (kept
for comm-free replay)``.

Inside a plain ``torch.utils.checkpoint`` (non-reentrant, ``checkpoint_wrapper``
included) it reports that checkpoint instead: it keeps its inputs, and the saves of
its forward so far are recompute handles that cost nothing until backward. It has
no save regions, so the report has none.
"""

from __future__ import annotations

import sys
from typing import IO

from remat_dist.core import current_frame
from remat_dist.report._accounting import (
    TORCH_CHECKPOINT,
    Annotate,
    Ledger,
    breakdown_checkpoint,
    breakdown_torch_checkpoint,
    format_checkpoint_detail,
)
from remat_dist.report._format import format_bytes
from remat_dist.report._graph import running_torch_checkpoint

__all__ = ["format_current_memory_report", "print_current_memory_report"]


def format_current_memory_report(
    annotate: Annotate | None = None, *, inputs: bool = True
) -> str:
    """What the running checkpoint keeps so far, per kept region, as text.

    Call it inside a checkpointed function. Outside a checkpoint it says so instead
    of failing, so a call left in a model that also runs without checkpoints is
    harmless. During a replay it reports the record of the forward (nothing new is
    kept on replay) and says so.

    Args:
        annotate: ``tensor -> label`` (e.g. :func:`memory_snapshot_annotate`) for
            rows whose tensor the report can reach.
        inputs: also list the checkpoint's inputs (they are kept too).

    Returns:
        The report's text.

    Example::

        >>> def block(x):
        ...     h = remat_dist.region(attention, "attention", recompute=False)(x)
        ...     print(remat_dist.format_current_memory_report())
        ...     return mlp(h)
    """
    record = current_frame()
    if record is None:
        frame = running_torch_checkpoint()
        if frame is not None:
            cp = breakdown_torch_checkpoint(frame, TORCH_CHECKPOINT, Ledger())
            lines = format_checkpoint_detail(cp, annotate, inputs=inputs)
            lines[0] = (
                f"{TORCH_CHECKPOINT}: {format_bytes(cp.nbytes)} resident "
                f"({frame.recompute_handles} saves so far are recompute handles)"
            )
            return "\n".join(lines)
        return (
            "no checkpoint is running (format_current_memory_report reports the "
            "checkpoint whose forward calls it)"
        )
    cp = breakdown_checkpoint(record, record.name, Ledger())
    lines = format_checkpoint_detail(cp, annotate, inputs=inputs)
    if record.replaying:
        lines.insert(0, f"(replay of {record.name}: showing what its forward kept)")
    return "\n".join(lines)


def print_current_memory_report(
    file: IO[str] | None = None,
    annotate: Annotate | None = None,
    *,
    inputs: bool = True,
) -> None:
    """Print :func:`format_current_memory_report` (the arguments in torch_remat's order).

    Args:
        file: where to write (stdout by default).
        annotate, inputs: as for :func:`format_current_memory_report`.

    Returns:
        None.

    Example::

        >>> def block(x):
        ...     h = remat_dist.region(attention, "attention", recompute=False)(x)
        ...     remat_dist.print_current_memory_report()
        ...     return mlp(h)
    """
    print(
        format_current_memory_report(annotate=annotate, inputs=inputs),
        file=file or sys.stdout,
    )
