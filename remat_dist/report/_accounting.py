"""Per-storage accounting of what one checkpoint keeps, shared by the reports.

Every byte is counted once per storage, in the first place it is found. The saved
tensors report claims storages in this order: each checkpoint's save regions (in
forward order, each region's saves, then its outputs kept for replay), then the
checkpoints' inputs (remat_dist's and ``torch.utils.checkpoint``'s, in forward
order), then the saves of nodes outside every checkpoint. A storage
found again later is still listed where it appears, its size in parentheses and a
note naming where it was counted (it adds 0 B there).

Parameters (``nn.Parameter`` s, their views, and the storages of parameters found
on the graph) are not activations: they are left out of every activation total and
shown on one line of their own.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed support
    _DTensor = None

from remat_dist.core import CheckpointRecord, RegionRecord, SavedEntry
from remat_dist.report._format import format_bytes, plural, table
from remat_dist.report._graph import (
    StorageKey,
    TorchCheckpointFrame,
    is_parameter_tensor,
    packed_tensors,
    tensor_storages,
)

__all__ = [
    "KEPT_BY_LAYERS",
    "SELECTIVE_CACHE",
    "TORCH_CHECKPOINT",
    "Annotate",
    "CheckpointBreakdown",
    "Ledger",
    "RegionBreakdown",
    "StorageRow",
    "breakdown_checkpoint",
    "breakdown_torch_checkpoint",
    "format_checkpoint_detail",
]

TORCH_CHECKPOINT = "torch.utils.checkpoint"
"""The ``kind`` of a :class:`CheckpointBreakdown` made from a call of torch's
non-reentrant checkpoint (``checkpoint_wrapper`` included)."""

KEPT_BY_LAYERS = "kept for comm-free replay"
SELECTIVE_CACHE = "cached by selective checkpointing"
"""Region kind of the op outputs torch's selective checkpointing keeps (a
``torch.utils.checkpoint`` call with a ``create_selective_checkpoint_contexts``
policy, torchtitan's selective "op" AC)."""
"""The ``kind`` of a :class:`RegionBreakdown` holding what the layers above keep on
a checkpoint's record (``RecordExtension.kept_tensors``): today the collective
outputs that ``collectives="save"`` keeps so that replay issues no communication."""

Annotate = Callable[[torch.Tensor], "str | None"]
"""Maps a saved tensor to a short label (allocation site, ...), or None."""


class Ledger:
    """Which storages were counted where; the one place bytes are summed."""

    def __init__(self, parameter_keys: set[StorageKey] | None = None) -> None:
        self.owner: dict[StorageKey, str] = {}
        self.parameter_keys: set[StorageKey] = set(parameter_keys or ())
        self.parameters: dict[StorageKey, int] = {}

    def claim(
        self, key: StorageKey, nbytes: int, where: str, *, parameter: bool
    ) -> tuple[int, str | None]:
        """Count ``nbytes`` of storage ``key`` for ``where`` unless counted before.

        Returns ``(bytes counted here, where it was counted before or None)``;
        parameters count 0 here and land in :attr:`parameters`.
        """
        if parameter or key in self.parameter_keys:
            self.parameter_keys.add(key)
            self.parameters.setdefault(key, nbytes)
            return 0, "parameter"
        prev = self.owner.get(key)
        if prev is not None:
            return 0, prev
        self.owner[key] = where
        return nbytes, None

    @property
    def parameter_bytes(self) -> int:
        return sum(self.parameters.values())


@dataclass
class StorageRow:
    """One storage in a report: its bytes and what it is."""

    nbytes: int
    """Bytes counted here (0 when counted elsewhere, or a parameter)."""
    storage_nbytes: int
    label: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    user_hook: bool = False
    counted_in: str | None = None
    tensor: torch.Tensor | None = None
    """A tensor on this storage, for annotations; held weakly (a kept report must
    not keep activations alive)."""
    global_shape: tuple[int, ...] | None = None
    """A DTensor's global shape (``shape`` is then this rank's shard's)."""

    def __post_init__(self) -> None:
        t = self.tensor
        self._ref = None if t is None else weakref.ref(t)
        self.tensor = None

    def live_tensor(self) -> torch.Tensor | None:
        return None if self._ref is None else self._ref()

    def cells(self, annotate: Annotate | None) -> list[str]:
        note = []
        if self.counted_in == "parameter":
            note.append("(parameter, not counted)")
        elif self.counted_in is not None:
            note.append(f"(counted in {self.counted_in})")
        if self.user_hook:
            note.append("[packed by user hook; size before packing]")
        tensor = self.live_tensor() if annotate is not None else None
        if tensor is not None:
            try:
                site = annotate(tensor)
            except Exception:  # an annotator must never break a report
                site = None
            if site:
                note.append(f"@ {site}")
        shown = self.nbytes if self.counted_in is None else self.storage_nbytes
        size = (
            format_bytes(shown)
            if self.counted_in is None
            else f"({format_bytes(shown)})"
        )
        shape = str(tuple(self.shape))
        if self.global_shape is not None and tuple(self.global_shape) != tuple(self.shape):
            shape += f" [global {tuple(self.global_shape)}]"
        return [
            size,
            self.label,
            shape,
            str(self.dtype).removeprefix("torch."),
            " ".join(note),
        ]


@dataclass
class RegionBreakdown:
    """What one save region keeps: its saves and its outputs kept for replay."""

    name: str
    local_name: str
    rows: list[StorageRow] = field(default_factory=list)
    kind: str = "save"
    """``"save"`` (a save region), :data:`KEPT_BY_LAYERS` (what the layers above
    keep on the record: collective outputs of comm-free replay) or
    :data:`SELECTIVE_CACHE` (a torch checkpoint's cached op outputs)."""

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    @property
    def storages(self) -> int:
        return sum(1 for r in self.rows if r.counted_in is None)


@dataclass
class CheckpointBreakdown:
    """One checkpoint's saves (per save region) and inputs, counted per storage."""

    name: str
    record_name: str
    regions: list[RegionBreakdown] = field(default_factory=list)
    inputs: list[StorageRow] = field(default_factory=list)
    user_hook_bytes: int = 0
    kind: str = "remat_dist"
    """``"remat_dist"`` or :data:`TORCH_CHECKPOINT` (no save regions: its forward's
    saves are recomputed; it keeps its inputs)."""
    recompute_handles: int = 0
    """For a torch checkpoint: its saves packed as recompute handles (0 B each)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the save regions (saves plus outputs kept for replay)."""
        return sum(r.nbytes for r in self.regions)

    @property
    def storages(self) -> int:
        return sum(r.storages for r in self.regions)

    @property
    def input_bytes(self) -> int:
        return sum(r.nbytes for r in self.inputs)

    @property
    def input_storages(self) -> int:
        return sum(1 for r in self.inputs if r.counted_in is None)

    def signature(self) -> tuple[Any, ...]:
        """Equal for checkpoints that keep the same things (names aside)."""
        return tuple(
            (
                r.local_name,
                tuple(
                    (s.nbytes, s.label, s.shape, s.dtype, s.counted_in is None)
                    for s in r.rows
                ),
            )
            for r in self.regions
        )

    def input_signature(self) -> tuple[Any, ...]:
        return tuple(
            (s.nbytes, s.shape, s.dtype, s.counted_in is None) for s in self.inputs
        )


def _entry_rows(
    entries: list[SavedEntry],
    where: str,
    ledger: Ledger,
    tensors: dict[StorageKey, torch.Tensor],
    outputs: dict[StorageKey, list[int]],
    default_label: str,
    labels: dict[StorageKey, list[str]] | None = None,
) -> list[StorageRow]:
    """Fold entries into one row per storage, in the order storages first appear."""
    by_key: dict[StorageKey, list[tuple[int, SavedEntry]]] = {}
    for i, e in enumerate(entries):
        by_key.setdefault(e.storage, []).append((i, e))
    rows = []
    for key, group in by_key.items():
        names: list[str] = []
        found = (labels or {}).get(key)
        if found and all(e.name is None for _, e in group):
            # unnamed saves: name them after the nodes that saved them
            counts = Counter(found)
            names = [n if c == 1 else f"{n} (x{c})" for n, c in counts.items()]
        else:
            for i, e in group:
                label = e.name if e.name is not None else default_label.format(i=i)
                if label not in names:
                    names.append(label)
        label = ", ".join(names)
        idx = outputs.get(key)
        if idx:
            label += f" (output at idx {', '.join(map(str, idx))})"
        widest = max((e for _, e in group), key=lambda e: e.nbytes)
        shape, global_shape = _entry_shapes(widest, tensors.get(key))
        parameter = any(e.is_parameter for _, e in group)
        storage_nbytes = max(e.storage_nbytes for _, e in group)
        counted, before = ledger.claim(key, storage_nbytes, where, parameter=parameter)
        rows.append(
            StorageRow(
                nbytes=counted,
                storage_nbytes=storage_nbytes,
                label=label,
                shape=shape,
                dtype=widest.dtype,
                device=widest.device,
                user_hook=any(e.packed_by_user_hook for _, e in group),
                counted_in=before,
                tensor=tensors.get(key),
                global_shape=global_shape,
            )
        )
    return rows


def local_shapes(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """``(shape on this rank, global shape or None)``: a DTensor's local shard and
    its global shape, a plain tensor's shape and None."""
    if _DTensor is None or not isinstance(t, _DTensor):
        return tuple(t.shape), None
    with torch.no_grad():
        return tuple(t.to_local().shape), tuple(t.shape)


def _entry_shapes(
    entry: SavedEntry, tensor: torch.Tensor | None
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """A saved entry's shape is the tensor's (a DTensor's global one) and its bytes
    this rank's: where they disagree, the entry is a shard, shown with the local
    shape of the tensor found on its storage when there is one."""
    shape = tuple(entry.shape)
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=entry.dtype).element_size()
    if numel * itemsize <= entry.nbytes:
        return shape, None
    if tensor is not None and tensor.numel() * tensor.element_size() == entry.nbytes:
        return tuple(tensor.shape), shape
    return shape, shape


def _output_keys(rr: RegionRecord) -> dict[StorageKey, list[int]]:
    """Storages of the region's outputs kept as tensors (free ones included), so
    that saves sharing them can be labelled ``output at idx j``."""
    keys: dict[StorageKey, list[int]] = {}
    for j, p in sorted(rr.persisted.items()):
        if p.unpack is None and isinstance(p.packed, torch.Tensor):
            for key, _, _ in tensor_storages(p.packed):
                keys.setdefault(key, []).append(j)
    return keys


def _persisted_rows(rr: RegionRecord, ledger: Ledger, where: str) -> list[StorageRow]:
    """Rows for the region's outputs kept for replay that cost bytes of their own."""
    rows: list[StorageRow] = []
    for j, p in sorted(rr.persisted.items()):
        if p.free:
            continue
        meta = rr.output_meta[j] if j < len(rr.output_meta) else None
        shape = tuple(meta[0]) if meta is not None else ()
        dtype = meta[3] if meta is not None else torch.float32
        device = meta[4] if meta is not None else torch.device("cpu")
        user_hook = not (p.unpack is None and isinstance(p.packed, torch.Tensor))
        found = [p.packed] if not user_hook else packed_tensors(p.packed)
        storages = [s for t in found for s in tensor_storages(t)]
        label = f"output {j} (kept for replay)"
        if not storages:
            # Packed into something without tensors: count what the hook was given.
            key = ("packed", id(p))
            counted, before = ledger.claim(key, p.nbytes, where, parameter=False)
            rows.append(
                StorageRow(
                    counted, p.nbytes, label, shape, dtype, device, user_hook, before
                )
            )
            continue
        for key, nbytes, t in storages:
            counted, before = ledger.claim(
                key, nbytes, where, parameter=is_parameter_tensor(t)
            )
            rows.append(
                StorageRow(
                    counted, nbytes, label, shape, dtype, device, user_hook, before, t
                )
            )
    return rows


def _extension_rows(record: CheckpointRecord, ledger: Ledger, where: str) -> list[StorageRow]:
    """Rows for what the layers above keep on the record (``RecordExtension``):
    collective outputs of comm-free replay, say."""
    rows: list[StorageRow] = []
    for ext in record.extensions.values():
        kept = getattr(ext, "kept_tensors", None)
        if kept is None:
            continue
        for label, t in kept():
            for key, nbytes, tensor in tensor_storages(t):
                counted, before = ledger.claim(key, nbytes, where, parameter=False)
                shape, global_shape = local_shapes(t)
                rows.append(
                    StorageRow(
                        counted, nbytes, label, shape, t.dtype,
                        tensor.device, False, before, tensor, global_shape,
                    )
                )
    return rows


def breakdown_checkpoint(
    record: CheckpointRecord,
    name: str,
    ledger: Ledger,
    tensors: dict[StorageKey, torch.Tensor] | None = None,
    labels: dict[StorageKey, list[str]] | None = None,
    *,
    with_inputs: bool = True,
) -> CheckpointBreakdown:
    """Count what ``record`` keeps into ``ledger``: per save region, per storage.

    ``tensors`` maps storage keys to live tensors found on the graph (used only for
    annotations), ``labels`` to ``NodeType.saved_name`` of the nodes that saved
    them (names for saves that ``save_for_backward`` did not name). ``with_inputs=False`` leaves the inputs for a later pass, so that
    every checkpoint's saves are claimed before any checkpoint's inputs.
    """
    tensors = tensors or {}
    out = CheckpointBreakdown(name=name, record_name=record.name)
    for rr in record.regions:
        if not rr.is_save:
            continue
        where = f"{name}::{rr.local_name}"
        rows = _entry_rows(
            list(rr.saved),
            where,
            ledger,
            tensors,
            _output_keys(rr),
            "saved.{i}",
            labels,
        )
        persisted_rows = _persisted_rows(rr, ledger, where)
        region = RegionBreakdown(
            name=where, local_name=rr.local_name, rows=rows + persisted_rows
        )
        out.regions.append(region)
        out.user_hook_bytes += sum(r.nbytes for r in region.rows if r.user_hook)
    kept = _extension_rows(record, ledger, f"{name}::kept")
    if kept:
        out.regions.append(
            RegionBreakdown(
                name=f"{name}::kept", local_name="kept", rows=kept, kind=KEPT_BY_LAYERS
            )
        )
    if with_inputs:
        add_inputs(out, record, ledger)
    return out


def add_inputs(
    out: CheckpointBreakdown, record: CheckpointRecord, ledger: Ledger
) -> None:
    """Count ``record``'s tensor inputs (kept by the checkpoint so replay can start)."""
    user_hook = record.options.saved_tensors_hooks is not None
    rows = _entry_rows(
        list(record.input_entries), f"{out.name} inputs", ledger, {}, {}, "input {i}"
    )
    for r in rows:
        r.user_hook = r.user_hook or user_hook
    out.inputs = rows
    out.user_hook_bytes += sum(r.nbytes for r in rows if r.user_hook)


def breakdown_torch_checkpoint(
    frame: TorchCheckpointFrame, name: str, ledger: Ledger
) -> CheckpointBreakdown:
    """Count what one ``torch.utils.checkpoint`` call keeps: its inputs (the tensors
    its forward saved are recomputed on backward and cost nothing until then) and,
    under a selective policy, the op outputs it cached (a ``<name>::selective cache``
    region)."""
    out = CheckpointBreakdown(
        name=name,
        record_name=TORCH_CHECKPOINT,
        kind=TORCH_CHECKPOINT,
        recompute_handles=frame.recompute_handles,
    )
    inputs = [(frame.input_name(i), t, user_hook) for i, t, user_hook in frame.inputs()]
    out.inputs = _storage_rows(inputs, f"{name} inputs", ledger)
    out.user_hook_bytes = sum(r.nbytes for r in out.inputs if r.user_hook)
    cache_name = f"{name}::selective cache"
    cached = _storage_rows(
        [(f"cached.{j}", t, False) for j, t in enumerate(frame.cached())],
        cache_name,
        ledger,
    )
    if cached:
        out.regions.append(
            RegionBreakdown(
                name=cache_name,
                local_name="selective cache",
                rows=cached,
                kind=SELECTIVE_CACHE,
            )
        )
    return out


def _storage_rows(
    tensors: list[tuple[str, torch.Tensor, bool]], where: str, ledger: Ledger
) -> list[StorageRow]:
    """One row per storage of ``(label, tensor, packed by a user hook)``, claimed
    in ``ledger`` under ``where``; labels of tensors sharing a storage are joined."""
    rows: dict[StorageKey, StorageRow] = {}
    for label, t, user_hook in tensors:
        for key, nbytes, plain in tensor_storages(t):
            row = rows.get(key)
            if row is not None:  # another tensor on the same storage: one row
                if label not in row.label:
                    row.label += f", {label}"
                continue
            counted, before = ledger.claim(
                key, nbytes, where, parameter=is_parameter_tensor(t)
            )
            shape, global_shape = local_shapes(t)
            rows[key] = StorageRow(
                counted, nbytes, label, shape, t.dtype,
                plain.device, user_hook, before, plain, global_shape,
            )
    return list(rows.values())


def format_checkpoint_detail(
    cp: CheckpointBreakdown, annotate: Annotate | None = None, *, inputs: bool = False
) -> list[str]:
    """The torch_remat-style block for one checkpoint::

    layers.0: 28 B resident in 2 storage(s)
    layers.0::attn.softmax: 28 B
      12 B  lse    (3,)  float32
      16 B  probs  (4,)  float32
    """
    lines = [
        f"{cp.name}: {format_bytes(cp.nbytes)} resident in {cp.storages} storage(s)"
    ]
    for region in cp.regions:
        lines.append(f"{region.name}: {format_bytes(region.nbytes)}")
        lines.extend(
            table([r.cells(annotate) for r in region.rows], indent="  ", right=(0,))
        )
    if inputs and cp.inputs:
        lines.append(
            f"{cp.name} inputs: {format_bytes(cp.input_bytes)} in "
            f"{plural(cp.input_storages, 'storage')} (kept so that replay can start)"
        )
        lines.extend(
            table([r.cells(annotate) for r in cp.inputs], indent="  ", right=(0,))
        )
    return lines
