"""Print the saved-tensors report when CUDA runs out of memory.

``attach_oom_observer()`` registers :func:`oom_observer` with the CUDA caching
allocator (``torch._C._cuda_attach_out_of_memory_observer``). When an allocation
fails, before the ``OutOfMemoryError`` is raised, it prints what backward is
holding on to: the saved-tensors report of every live graph (found with
:func:`discover_autograd_roots` unless roots are given), plus the checkpoint whose
forward is running at that moment, which no root reaches yet.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable
from typing import IO, Any

from remat_dist._torch import _cuda
from remat_dist.report._accounting import Annotate
from remat_dist.report._format import format_bytes

__all__ = [
    "OOMObserver",
    "attach_oom_observer",
    "format_oom_saved_tensors_report",
    "oom_observer",
]

OOMObserver = Callable[[int, int, int, int], None]
"""``(device, alloc, device_allocated, device_free) -> None``, the allocator's call."""


def format_oom_saved_tensors_report(
    device: int | None = None,
    alloc: int | None = None,
    device_allocated: int | None = None,
    device_free: int | None = None,
    *,
    roots: Iterable[Any] | Callable[[], Iterable[Any]] | None = None,
    annotate: Annotate | None = None,
) -> str:
    """The text :func:`oom_observer` prints: the failed request, then the reports.

    Args:
        device, alloc, device_allocated, device_free: the allocator's numbers, as
            the CUDA allocator passes them to an out-of-memory observer. Without
            them (torch_remat's ``format_oom_saved_tensors_report(annotate=...)``)
            the first line says only that this is the report at out of memory.
        roots: the roots, or a callable returning them; ``None`` finds them
            (:func:`discover_autograd_roots`).
        annotate: as for :func:`format_saved_tensors_report`.

    Returns:
        The report's text.

    Example::

        >>> try:
        ...     loss.backward()
        ... except torch.cuda.OutOfMemoryError:
        ...     print(remat_dist.format_oom_saved_tensors_report(roots=[loss]))
        ...     raise
    """
    from remat_dist.core import current_frame
    from remat_dist.report._current import format_current_memory_report
    from remat_dist.report._roots import discover_autograd_roots
    from remat_dist.report._saved import format_saved_tensors_report

    if None in (device, alloc, device_allocated, device_free):
        lines = ["remat_dist: saved tensors at CUDA out of memory"]
    else:
        lines = [
            f"remat_dist: CUDA out of memory on device {device}: tried to allocate "
            f"{format_bytes(alloc)} with {format_bytes(device_allocated)} allocated "
            f"and {format_bytes(device_free)} free"
        ]
    if callable(roots):
        found = list(roots())
    elif roots is None:
        found = discover_autograd_roots()
    else:
        found = list(roots)
    if found:
        lines.append(format_saved_tensors_report(*found, annotate=annotate))
    else:
        lines.append("no live autograd graph found")
    if current_frame() is not None:
        lines += ["", "checkpoint running when the allocation failed:"]
        lines.append(format_current_memory_report(annotate=annotate))
    return "\n".join(lines)


def oom_observer(
    roots: Iterable[Any] | Callable[[], Iterable[Any]] | int | None = None,
    *allocator_args: int,
    annotate: Annotate | Callable[[], Annotate] | None = None,
    file: IO[str] | None = None,
) -> OOMObserver | None:
    """An out-of-memory observer that prints the saved-tensors report.

    Two call shapes. ``oom_observer(roots, annotate=..., file=...)`` returns an
    observer to attach (see :func:`attach_oom_observer`). Attached itself, as
    torch_remat's is (``torch._C._cuda_attach_out_of_memory_observer(
    remat_dist.oom_observer)``), the allocator calls it with ``(device, alloc,
    device_allocated, device_free)`` and it prints the report of the live graphs
    to stderr at once.

    Args:
        roots: what to report on: a callable returning roots (called at OOM time,
            so it can read e.g. a weak reference to the current loss), a fixed
            iterable, or None to discover the live graphs with a ``gc`` pass.
            Do not pass tensors you want freed: the observer would keep them alive.
        annotate: a ``tensor -> label`` callable, or a zero-argument factory called
            at OOM time (``memory_snapshot_annotate`` takes a snapshot when called,
            so pass the function itself to label rows with allocation sites).
        file: where to print (stderr by default).

    The observer never raises: a failure while reporting is printed instead, so it
    cannot hide the original out-of-memory error.

    Returns:
        The observer (first call shape), or ``None`` (when the allocator calls it).

    Example::

        >>> observer = remat_dist.oom_observer(lambda: [loss_ref()], file=sys.stderr)
        >>> torch._C._cuda_attach_out_of_memory_observer(observer)
    """
    if allocator_args:
        if not (isinstance(roots, int) and len(allocator_args) == 3):
            raise TypeError(
                "remat_dist.oom_observer: called with positional numbers it is the "
                "allocator's observer, (device, alloc, device_allocated, "
                "device_free); to build an observer pass roots=... only."
            )
        oom_observer(annotate=annotate, file=file)(roots, *allocator_args)
        return None
    fixed = None if roots is None or callable(roots) else list(roots)

    def observe(
        device: int, alloc: int, device_allocated: int, device_free: int
    ) -> None:
        out = file or sys.stderr
        try:
            label = annotate
            if label is not None and _is_factory(label):
                label = label()  # type: ignore[call-arg]
            text = format_oom_saved_tensors_report(
                device,
                alloc,
                device_allocated,
                device_free,
                roots=roots if fixed is None else fixed,
                annotate=label,  # type: ignore[arg-type]
            )
        except Exception as e:  # never mask the OOM itself
            text = f"remat_dist: the OOM saved-tensors report failed: {e!r}"
        print(text, file=out, flush=True)

    return observe


def _is_factory(fn: Any) -> bool:
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [
        p
        for p in params
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return not required


def attach_oom_observer(
    roots: Iterable[Any] | Callable[[], Iterable[Any]] | None = None,
    *,
    annotate: Annotate | Callable[[], Annotate] | None = None,
    file: IO[str] | None = None,
) -> OOMObserver | None:
    """Register :func:`~remat_dist.oom_observer` with the CUDA allocator.

    At an out-of-memory error the observer prints what backward would have needed,
    from the roots given (or the live graphs), with allocation sites when
    ``annotate`` gives them. The allocator keeps observers for the life of the
    process.

    Args:
        roots: the roots, or a callable returning them at the error; ``None`` finds
            them (:func:`~remat_dist.discover_autograd_roots`).
        annotate: ``tensor -> label``, or a callable returning one at the error
            (``remat_dist.memory_snapshot_annotate``).
        file: where to write (stderr by default).

    Returns:
        The observer, or ``None`` without CUDA (with a warning, so a training
        script can call it unconditionally).

    Example::

        >>> torch.cuda.memory._record_memory_history(max_entries=100_000)
        >>> remat_dist.report.attach_oom_observer(annotate=remat_dist.memory_snapshot_annotate)
    """
    import torch

    if not torch.cuda.is_available():
        warnings.warn(
            "remat_dist.report.attach_oom_observer: CUDA is not available; no observer "
            "attached",
            stacklevel=2,
        )
        return None
    observer = oom_observer(roots, annotate=annotate, file=file)
    torch.cuda.init()
    _cuda.attach_oom_observer(observer)
    return observer
