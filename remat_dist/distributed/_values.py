"""``determinism_check="values"`` across ranks: the inputs of replayed collectives,
and every value mismatch reported on every rank at stake.

Verification (``_verify``) checks that a replay issues the collectives of its
forward: op, group, shapes, dtypes, order. A replay that sends *other data* with
the same signature (a top-k router that breaks a tie another way on recompute and
routes other tokens with the same split sizes) passes it, replays without a word,
and every rank's gradients are wrong. With the value check on (per checkpoint, or
``REMAT_DIST_DETERMINISM_CHECK=values``), this observer, registered after the
ledger's so that its extent is the innermost one:

* forward: fingerprints the input of each collective before it is issued
  (``core.fingerprint``: an on-device integer hash, no copy kept) and, when the
  ledger recorded the call (FSDP2's own collectives are not), keeps it under the
  ledger entry's position;
* replay: fingerprints the input of each collective the verifier accepts and, at
  the replay's end, compares them all with the forward's in one go (one device
  synchronisation per replay);
* a difference, here or in the core's comparison of the saved tensors
  (``on_replay_values``), becomes this graph task's failure (``_step``): the
  end-of-backward report that the ranks at stake run anyway carries it, and every
  rank of the stake raises :class:`~remat_dist.errors.ReplayValueMismatchError`, naming
  the checkpoint, the collective or saved tensor and the ranks, before the
  optimizer step. Nothing differs: nothing more is sent. A checkpoint at stake
  nowhere (FSDP2 with checkpoints inside the units) raises on its own rank at
  the end of backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from remat_dist._errors import ReplayValueMismatchError
from remat_dist._logging import get_logger
from remat_dist.core import (
    CheckpointRecord,
    fingerprint,
    fingerprints_differ,
    raise_at_backward_end,
    register_observer,
)
from remat_dist.distributed import _step
from remat_dist.distributed._collectives import CollectiveEntry
from remat_dist.distributed._intercept import (
    CollectiveCall,
    ObserverExtent,
    push_observer,
)
from remat_dist.distributed._ready import dist_ready
from remat_dist.distributed._replay import LedgerState, ledger_of
from remat_dist.distributed._value_texts import DIFFER, collective_input_text

__all__ = ["inputs_fingerprint"]

log = get_logger(__name__)


def inputs_fingerprint(call: CollectiveCall) -> torch.Tensor | None:
    """The fingerprint of what ``call`` reads (None when it reads nothing)."""
    parts = [fp for t in call.input_tensors() if (fp := fingerprint(t)) is not None]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass
class _Values:
    """One checkpoint's collective-input fingerprints."""

    forward: dict[int, torch.Tensor] = field(default_factory=dict)
    """Ledger position -> the forward's fingerprint."""
    replay: list[tuple[int, CollectiveEntry, torch.Tensor]] = field(
        default_factory=list
    )
    """The current replay's ``(index in the replay, entry, fingerprint)``."""
    total: int = 0
    """Collectives the current replay is to issue."""
    saved: list[str] = field(default_factory=list)
    """The core's saved-tensor mismatch of the current replay, said after the
    collectives' (the cause comes before its effects)."""
    extent: ObserverExtent | None = None
    """Pushed by ``on_checkpoint_start``, popped by ``on_checkpoint_end``."""


_values: weakref.WeakKeyDictionary[CheckpointRecord, _Values] = (
    weakref.WeakKeyDictionary()
)


class _Fingerprint:
    """The innermost collective observer of a checkpoint's forward or replay."""

    def __init__(self, values: _Values, state: LedgerState, verifier: Any) -> None:
        self.values = values
        self.state = state
        self.verifier = verifier

    def on_collective(self, call: CollectiveCall, issue: Any) -> Any:
        fp = inputs_fingerprint(call)  # before the op writes its buffers
        verifier = self.verifier
        if verifier is None:  # forward: keep it if the ledger recorded the call
            before = len(self.state.ledger)
            result = issue()
            ledger = self.state.ledger  # made by the first collective recorded
            if fp is not None and len(ledger) > before:
                self.values.forward[ledger.entries[-1].position] = fp
            return result
        before = verifier.position
        result = issue()
        if fp is not None and verifier.position == before + 1:
            entry = verifier.expected[before]
            if entry.position in self.values.forward:
                self.values.replay.append((before, entry, fp))
        return result


class _ValuesObserver:
    values_check_only = True

    def on_checkpoint_start(self, record: CheckpointRecord, replay: bool) -> None:
        if not record.values_check or not dist_ready():
            return
        state = ledger_of(record)
        if state is None:
            return
        if not replay:
            values = _values[record] = _Values()
            verifier = None
        else:
            values = _values.get(record)
            verifier = getattr(state, "_observer", None)
            if values is None or not values.forward or verifier is None:
                return
            values.replay, values.saved = [], []
            values.total = len(verifier.expected)
        values.extent = push_observer(_Fingerprint(values, state, verifier))

    def on_checkpoint_end(
        self, record: CheckpointRecord, replay: bool, error: BaseException | None
    ) -> None:
        if not record.values_check:
            return
        values = _values.get(record)
        if values is None or values.extent is None:
            return
        extent, values.extent = values.extent, None
        extent.pop()
        replayed, values.replay = values.replay, []
        saved, values.saved = values.saved, []
        if not replay or error is not None:
            return
        differ: list[int] = []
        if replayed:
            forward = [values.forward[e.position] for _, e, _ in replayed]
            differ = fingerprints_differ(forward, [fp for *_, fp in replayed])
        if not differ:
            if saved:
                _report(record, saved[0])
            return
        index, entry, _ = replayed[differ[0]]
        text = collective_input_text(
            torch.distributed.get_rank(),
            record.name,
            index,
            values.total,
            entry.describe(),
            entry.position,
            len(differ),
        )
        if saved:  # its first line: which saved tensor differs too
            text += "\nAlso " + saved[0].split("\n", 1)[0].split(f"{DIFFER}: ", 1)[-1]
        _report(record, text)

    def on_replay_values(self, record: CheckpointRecord, text: str) -> bool:
        """The core found a saved tensor of another value: name the rank, report it
        with the collectives' mismatches."""
        if not dist_ready():
            return False
        text = f"rank {torch.distributed.get_rank()}, {text}"
        values = _values.get(record)
        if values is not None and values.extent is not None:
            values.saved.append(text)  # reported with the collectives' at the end
        else:
            _report(record, text)
        return True


def _report(record: CheckpointRecord, message: str) -> None:
    """The step fails on every rank at stake; at stake nowhere, this rank raises at
    the end of backward."""
    state = ledger_of(record)
    log.warning(
        "replay of '%s' computed other values than its forward: %s",
        record.name,
        message,
    )
    if state is not None and state.stakes:
        _step.current_step().fail(message)
        return
    error = raise_at_backward_end(ReplayValueMismatchError(f"remat_dist: {message}"))
    if error is not None:
        raise error


_handle = register_observer(_ValuesObserver())
