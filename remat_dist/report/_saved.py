"""``format_saved_tensors_report``: everything backward will need, after forward.

From some roots (usually the loss) the report walks the autograd graph once and
counts, per storage and each storage once:

* per checkpoint (``region_name``), what its save regions keep: their saves and
  the outputs kept so that replay can feed later code; under
  ``collectives="save"`` also the collective outputs kept for comm-free replay
  (a ``<name>::kept`` region, summed on an "of which" line and in
  ``kept_collective_bytes``);
* the checkpoints' inputs, which the checkpoint keeps so that replay can start
  (``saved_tensors_hooks`` never sees them inside the checkpoint, and they are
  often the largest cost);
* what nodes outside every checkpoint save, per autograd node type.

Calls of ``torch.utils.checkpoint`` (non-reentrant, ``checkpoint_wrapper``
included) are regions too, named ``torch.utils.checkpoint.<i>`` in forward order:
their forward's saves are recomputed (recompute handles, 0 B), so what they keep
is their inputs, counted with the checkpoint inputs and labelled as torch's.

Tensors the checkpoint will recompute cost nothing until backward. A ``DTensor``
counts its local shard. Parameters are not activations: they are excluded from
the totals and shown on one line. Saves packed by a user pack hook are counted at
the size the hook was given, and flagged (the hook decides where they live).

Checkpoints that keep the same things are grouped: ``x4  layers.0-3``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from remat_dist.report._accounting import (
    KEPT_BY_LAYERS,
    TORCH_CHECKPOINT,
    Annotate,
    CheckpointBreakdown,
    Ledger,
    StorageRow,
    add_inputs,
    breakdown_checkpoint,
    breakdown_torch_checkpoint,
    format_checkpoint_detail,
    local_shapes,
)
from remat_dist.report._format import compress_names, format_bytes, plural, table
from remat_dist.report._graph import (
    GraphScan,
    StorageKey,
    is_parameter_tensor,
    scan_graph,
    tensor_storages,
)

__all__ = [
    "OutsideGroup",
    "SavedTensorsReport",
    "build_saved_tensors_report",
    "format_saved_tensors_report",
    "print_saved_tensors_report",
    "saved_tensors_summary",
]


OUTSIDE_ROWS = 3
"""With ``annotate``, how many storages of each outside node type are listed."""


@dataclass
class OutsideGroup:
    """Saves of the nodes of one type outside every checkpoint."""

    node_type: str
    rows: list[StorageRow] = field(default_factory=list)
    nodes: set[int] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    @property
    def storages(self) -> int:
        return sum(1 for r in self.rows if r.counted_in is None and r.nbytes)


def _group_rows(groups: Any, size: Any) -> list[str]:
    """One table row per group of identical checkpoints: bytes (each), count,
    compressed names, storages; ``size(cp) -> (bytes, storages)``."""
    rows = []
    for members in groups:
        nbytes, storages = size(members[0])
        each = " each" if len(members) > 1 else ""
        rows.append(
            [
                format_bytes(nbytes),
                f"x{len(members)}",
                compress_names([m.name for m in members]),
                f"({plural(storages, 'storage')}{each})",
            ]
        )
    return table(rows, indent="  ", right=(0,))


SCOPE_STATE = "gradient_checkpoint_scope state"
"""The outside group for what ``gradient_checkpoint_scope`` records keep."""


@dataclass
class SavedTensorsReport:
    """The structured saved-tensors report of one process (see module doc).

    ``total_bytes == regions_bytes + checkpoint_input_bytes + outside_regions_bytes``.
    """

    checkpoints: list[CheckpointBreakdown]
    outside: list[OutsideGroup]
    parameter_bytes: int
    parameter_storages: int
    nodes: int = 0

    @property
    def regions_bytes(self) -> int:
        return sum(cp.nbytes for cp in self.checkpoints)

    @property
    def checkpoint_input_bytes(self) -> int:
        return sum(cp.input_bytes for cp in self.checkpoints)

    @property
    def torch_checkpoints(self) -> list[CheckpointBreakdown]:
        """The ``torch.utils.checkpoint`` calls among :attr:`checkpoints`."""
        return [cp for cp in self.checkpoints if cp.kind == TORCH_CHECKPOINT]

    @property
    def torch_checkpoint_input_bytes(self) -> int:
        """The part of :attr:`checkpoint_input_bytes` kept by torch's checkpoint."""
        return sum(cp.input_bytes for cp in self.torch_checkpoints)

    @property
    def kept_collective_bytes(self) -> int:
        """The part of :attr:`regions_bytes` that is collective outputs kept for
        comm-free replay (``collectives="save"``)."""
        return sum(
            r.nbytes for cp in self.checkpoints for r in cp.regions if r.kind == KEPT_BY_LAYERS
        )

    @property
    def kept_collective_storages(self) -> int:
        return sum(
            r.storages for cp in self.checkpoints for r in cp.regions if r.kind == KEPT_BY_LAYERS
        )

    @property
    def outside_regions_bytes(self) -> int:
        return sum(g.nbytes for g in self.outside)

    @property
    def total_bytes(self) -> int:
        return (
            self.regions_bytes
            + self.checkpoint_input_bytes
            + self.outside_regions_bytes
        )

    @property
    def user_hook_bytes(self) -> int:
        return sum(cp.user_hook_bytes for cp in self.checkpoints) + sum(
            r.nbytes for g in self.outside for r in g.rows if r.user_hook
        )

    def summary(self) -> dict[str, Any]:
        """JSON-ready per-process numbers (what the cross-rank report gathers)."""
        return {
            "total_bytes": self.total_bytes,
            "regions_bytes": self.regions_bytes,
            "outside_regions_bytes": self.outside_regions_bytes,
            "checkpoint_input_bytes": self.checkpoint_input_bytes,
            "parameter_bytes": self.parameter_bytes,
            "user_hook_bytes": self.user_hook_bytes,
            "kept_collective_bytes": self.kept_collective_bytes,
            "regions": [_region_summary(cp) for cp in self.checkpoints],
            "torch_checkpoint": {
                "regions": len(self.torch_checkpoints),
                "input_bytes": self.torch_checkpoint_input_bytes,
                "recompute_handles": sum(
                    cp.recompute_handles for cp in self.torch_checkpoints
                ),
                "cached_bytes": sum(cp.nbytes for cp in self.torch_checkpoints),
            },
            "outside": [
                {"node_type": g.node_type, "bytes": g.nbytes, "nodes": len(g.nodes)}
                for g in self.outside
            ],
        }

    def format(self, annotate: Annotate | None = None) -> str:
        """The text report (torch_remat's layout, plus inputs and parameters)."""
        n_regions = len(self.checkpoints)
        lines = [
            f"saved for backward: {format_bytes(self.total_bytes)} resident -- "
            f"{n_regions} region(s) {format_bytes(self.regions_bytes)}, "
            f"checkpoint inputs {format_bytes(self.checkpoint_input_bytes)}, "
            f"outside regions {format_bytes(self.outside_regions_bytes)}"
        ]
        if self.user_hook_bytes:
            lines.append(
                f"of which packed by user hooks: {format_bytes(self.user_hook_bytes)} "
                "(size before packing)"
            )
        if self.kept_collective_bytes:
            lines.append(
                f"of which collective outputs kept for comm-free replay: "
                f"{format_bytes(self.kept_collective_bytes)} in "
                f"{plural(self.kept_collective_storages, 'storage')} "
                '(collectives="save"; in the regions\' bytes)'
            )
        torch_cps = self.torch_checkpoints
        if torch_cps:
            lines.append(
                f"of which torch.utils.checkpoint inputs: "
                f"{format_bytes(self.torch_checkpoint_input_bytes)} in "
                f"{plural(sum(cp.input_storages for cp in torch_cps), 'storage')} "
                f"({plural(len(torch_cps), 'region')}; their forward saves are "
                f"{sum(cp.recompute_handles for cp in torch_cps)} recompute handles, "
                "0 B until backward)"
            )
            cached = sum(cp.nbytes for cp in torch_cps)
            if cached:
                lines.append(
                    "of which op outputs cached by torch's selective checkpointing: "
                    f"{format_bytes(cached)} (in the regions' bytes)"
                )
        lines.append(
            f"parameters saved (not counted above): {format_bytes(self.parameter_bytes)} in "
            f"{plural(self.parameter_storages, 'storage')}"
        )
        region_groups = _group(self.checkpoints, lambda cp: (cp.kind, cp.signature()))
        if self.checkpoints:
            lines += ["", "regions:"]
            lines += _group_rows(region_groups, lambda cp: (cp.nbytes, cp.storages))
            lines += [
                "",
                f"checkpoint inputs: {format_bytes(self.checkpoint_input_bytes)} in "
                f"{plural(sum(cp.input_storages for cp in self.checkpoints), 'storage')}",
            ]
            lines += _group_rows(
                _group(self.checkpoints, lambda cp: (cp.kind, cp.input_signature())),
                lambda cp: (cp.input_bytes, cp.input_storages),
            )
        shown = [g for g in self.outside if g.nbytes]
        lines += [
            "",
            f"outside regions: {format_bytes(self.outside_regions_bytes)} in "
            f"{plural(sum(g.storages for g in shown), 'storage')}",
        ]
        rows = []
        for g in sorted(shown, key=lambda g: -g.nbytes):
            rows.append([format_bytes(g.nbytes), f"{g.node_type} (x{len(g.nodes)})"])
            if annotate is not None:
                # with annotations, the heaviest storages of each node type too
                counted = [r for r in g.rows if r.nbytes and r.counted_in is None]
                for r in sorted(counted, key=lambda r: -r.nbytes)[:OUTSIDE_ROWS]:
                    size, _, shape, dtype, note = r.cells(annotate)
                    if "@ " in note:
                        rows.append(["", f"  {size}  {shape}  {dtype}  {note}"])
        lines += table(rows, indent="  ", right=(0,))
        detailed = [
            m for m in region_groups if m[0].regions or m[0].kind == TORCH_CHECKPOINT
        ]
        if detailed:
            lines += ["", "region detail:"]
            for members in detailed:
                lines.append(
                    f"[x{len(members)}: {compress_names([m.name for m in members])}]"
                )
                lines += format_checkpoint_detail(members[0], annotate, inputs=True)
        return "\n".join(lines)


def _region_summary(cp: CheckpointBreakdown) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": cp.name,
        "bytes": cp.nbytes,
        "storages": cp.storages,
        "input_bytes": cp.input_bytes,
    }
    if cp.kind == TORCH_CHECKPOINT:  # keys added for torch's checkpoint only
        d["kind"] = TORCH_CHECKPOINT
        d["recompute_handles"] = cp.recompute_handles
    return d


def _group(
    items: list[CheckpointBreakdown], key: Any
) -> list[list[CheckpointBreakdown]]:
    groups: dict[Any, list[CheckpointBreakdown]] = {}
    for cp in items:
        groups.setdefault(key(cp), []).append(cp)
    return list(groups.values())


def _unique_names(scan: GraphScan) -> list[str]:
    counts: dict[str, int] = {}
    names = []
    for record in scan.records:
        n = counts.get(record.name, 0) + 1
        counts[record.name] = n
        names.append(record.name if n == 1 else f"{record.name}#{n}")
    return names


def _resolve_roots(roots: Any, more: tuple[Any, ...]) -> Iterable[Any]:
    given = tuple(r for r in (roots, *more) if r is not None)
    if given:
        return given
    from remat_dist.report._roots import discover_autograd_roots

    return discover_autograd_roots()


def build_saved_tensors_report(roots: Any = None, *more: Any) -> SavedTensorsReport:
    """Walk the graph from the roots and count what backward will need.

    Roots: tensors (usually the loss), autograd nodes, or lists/tuples/dicts of
    them, as ``roots`` (torch_remat's keyword) and further positional arguments
    (``build_saved_tensors_report(loss_a, loss_b)``). With none,
    :func:`discover_autograd_roots` finds the live graphs (a ``gc`` pass).
    """
    scan = scan_graph(_resolve_roots(roots, more))
    ledger = Ledger(scan.parameter_keys)
    tensors: dict[StorageKey, torch.Tensor] = {}
    labels: dict[StorageKey, list[str]] = {}
    for t, label in scan.region_tensors:
        for key, _, plain in tensor_storages(t):
            tensors.setdefault(key, plain)
            labels.setdefault(key, []).append(label)
    remat_cps = [
        breakdown_checkpoint(record, name, ledger, tensors, labels, with_inputs=False)
        for record, name in zip(scan.records, _unique_names(scan), strict=True)
    ]
    # inputs in forward order, remat_dist's and torch.utils.checkpoint's together
    order: list[tuple[int, int, int]] = [
        (seq, 0, i) for i, seq in enumerate(scan.record_seqs)
    ] + [(f.seq, 1, i) for i, f in enumerate(scan.torch_frames)]
    checkpoints: list[CheckpointBreakdown] = []
    for _, is_torch, i in sorted(order):
        if is_torch:
            name = f"{TORCH_CHECKPOINT}.{i}"
            checkpoints.append(
                breakdown_torch_checkpoint(scan.torch_frames[i], name, ledger)
            )
        else:
            add_inputs(remat_cps[i], scan.records[i], ledger)
            checkpoints.append(remat_cps[i])
    groups: dict[str, OutsideGroup] = {}
    for save in scan.outside:
        parameter = is_parameter_tensor(save.tensor)
        group = groups.setdefault(save.node_type, OutsideGroup(save.node_type))
        for key, nbytes, plain in tensor_storages(save.tensor):
            where = f"outside regions: {save.node_type}"
            counted, before = ledger.claim(key, nbytes, where, parameter=parameter)
            if counted:
                group.nodes.add(save.node_index)
            group.rows.append(
                StorageRow(
                    nbytes=counted,
                    storage_nbytes=nbytes,
                    label=save.node_type,
                    shape=local_shapes(save.tensor)[0],
                    dtype=save.tensor.dtype,
                    device=plain.device,
                    user_hook=save.user_hook,
                    counted_in=before,
                    tensor=plain,
                    global_shape=local_shapes(save.tensor)[1],
                )
            )
    if scan.scopes:
        # a scope's tensors are recomputed; what it keeps itself is its RNG and
        # autocast snapshots (its inputs are counted where autograd saves them)
        group = groups.setdefault(SCOPE_STATE, OutsideGroup(SCOPE_STATE))
        for i, record in enumerate(scan.scopes.values()):
            state = int(record.stats()["state_bytes"])
            group.nodes.add(-1 - i)
            group.rows.append(
                StorageRow(
                    nbytes=state,
                    storage_nbytes=state,
                    label="RNG/autocast snapshots",
                    shape=(state,),
                    dtype=torch.uint8,
                    device=torch.device("cpu"),
                )
            )
    return SavedTensorsReport(
        checkpoints=checkpoints,
        outside=list(groups.values()),
        parameter_bytes=ledger.parameter_bytes,
        parameter_storages=len(ledger.parameters),
        nodes=scan.nodes,
    )


def format_saved_tensors_report(
    roots: Any = None, *more: Any, annotate: Annotate | None = None
) -> str:
    """What backward will need, reachable from the roots, as text.

    Every byte the autograd graph below the roots keeps: per checkpoint its inputs,
    what each kept region keeps and the outputs kept for replay; outside
    checkpoints, per autograd node type. Parameters are listed but not counted.
    DTensors show this rank's shape, the global one in brackets.

    Args:
        roots: tensors (usually the loss), autograd nodes, or lists, tuples or dicts
            of them; ``None`` finds the live graphs
            (:func:`discover_autograd_roots`, slow).
        *more: further roots.
        annotate: ``tensor -> label`` appended to each row, e.g.
            :func:`memory_snapshot_annotate` (allocation sites on CUDA).

    Returns:
        The report's text; its first line is the total.

    Example::

        >>> loss = model(x).sum()
        >>> print(remat_dist.format_saved_tensors_report(loss).splitlines()[0])
        >>> loss.backward()
    """
    return build_saved_tensors_report(roots, *more).format(annotate)


def print_saved_tensors_report(
    roots: Any = None,
    *more: Any,
    annotate: Annotate | None = None,
    file: IO[str] | None = None,
) -> None:
    """Print :func:`format_saved_tensors_report`.

    Args:
        roots, *more, annotate: as for :func:`format_saved_tensors_report`.
        file: where to write (stdout by default).

    Example::

        >>> loss = model(x).sum()
        >>> remat_dist.print_saved_tensors_report(loss)

    Returns:
        None.
    """
    print(
        format_saved_tensors_report(roots, *more, annotate=annotate),
        file=file or sys.stdout,
    )


def saved_tensors_summary(roots: Any = None, *more: Any) -> dict[str, Any]:
    """The report's numbers as a JSON-ready dict::

        {"total_bytes", "regions_bytes", "outside_regions_bytes",
         "checkpoint_input_bytes", "parameter_bytes", "user_hook_bytes",
         "kept_collective_bytes",
         "regions": [{"name", "bytes", "storages", "input_bytes"}, ...],
         "outside": [{"node_type", "bytes", "nodes"}, ...],
         "torch_checkpoint": {"regions", "input_bytes", "recompute_handles",
                              "cached_bytes"}}

    ``regions`` are the checkpoints in forward order; a region's ``bytes`` are what
    its save regions keep (inputs are in ``input_bytes``). Calls of
    ``torch.utils.checkpoint`` are regions named ``torch.utils.checkpoint.<i>``
    with two more keys, ``"kind": "torch.utils.checkpoint"`` and
    ``"recompute_handles"``; their ``bytes`` are what a selective policy cached
    (``create_selective_checkpoint_contexts``; 0 for a plain checkpoint, which
    recomputes everything its forward saved) and their inputs are also in
    ``checkpoint_input_bytes``; ``torch_checkpoint`` sums them. ``kept_collective_bytes`` is the part of
    ``regions_bytes`` that ``collectives="save"`` keeps (collective outputs, so that
    replay issues no communication).

    Args:
        roots, *more: as for :func:`~remat_dist.format_saved_tensors_report`.

    Returns:
        The dict above.

    Example::

        >>> loss = model(x).sum()
        >>> json.dumps(remat_dist.report.saved_tensors_summary(loss))
    """
    return build_saved_tensors_report(roots, *more).summary()
