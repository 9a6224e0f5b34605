"""The collective ledger of every checkpoint, and its verified or comm-free replay.

Attached to the core through its observer seam (``register_observer``): the core
never imports this. With a process group:

* forward: every collective issued inside the checkpoint is recorded in a
  :class:`CollectiveLedger` on the checkpoint's record (``collectives="save"`` also
  keeps their outputs);
* replay, ``collectives="replay"`` / ``"verify"``: each collective is checked
  against the ledger *before* it is issued; ``"save"``: none is issued, the kept
  outputs are served;
* the ranks agree through the c10d store (no collective) on the ledger before the
  replay issues its first collective and conclude through it at the end, and a rank
  that diverges mid-replay first releases its peers; so divergence raises
  :class:`~remat_dist.errors.CollectiveReplayError` on every rank within
  :data:`REPLAY_TIMEOUT_S`, never a hang.

FSDP2's own all-gathers and reduce-scatters are left out of the ledger: they belong
to FSDP2's state machine (which unshards before backward reaches the block and
skips its pre-forward on recompute), not to the checkpointed function, and may
legitimately not repeat on replay. They are counted in ``fsdp_collectives``.
Without an initialised process group nothing is recorded and nothing is paid.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from remat_dist.core._record import CheckpointRecord, RegionRecord, register_observer
from remat_dist.distributed._collectives import (
    CollectiveCall,
    CollectiveLedger,
    RecordCollectives,
    ServeCollectives,
    VerifyCollectives,
    observe_collectives,
)
from remat_dist.distributed._ledger_agreement import ReplayAgreement

__all__ = ["LEDGER_KEY", "REPLAY_TIMEOUT_S", "LedgerState", "ledger_of", "set_replay_timeout"]

LEDGER_KEY = "remat_dist.collectives"
"""``record.extensions`` key of a checkpoint's :class:`LedgerState`."""

REPLAY_TIMEOUT_S = 20.0
"""Default bound (seconds) for a rank to reach a replay's agreement point."""

_FSDP_FILES = ("/distributed/fsdp/_fully_shard/", "\\distributed\\fsdp\\_fully_shard\\")


_is_fsdp_code: dict[Any, bool] = {}


def _issued_by_fsdp() -> bool:
    """Whether FSDP2's code is on the stack of the collective being issued."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        hit = _is_fsdp_code.get(code)
        if hit is None:
            hit = _is_fsdp_code[code] = any(p in code.co_filename for p in _FSDP_FILES)
        if hit:
            return True
        frame = frame.f_back
    return False


@dataclass
class LedgerState:
    """What one checkpoint knows of its collectives (``record.extensions``)."""

    ledger: CollectiveLedger
    mode: str
    fsdp_collectives: int = 0
    """FSDP2 collectives issued inside the forward (not in the ledger)."""
    replays: list[dict[str, int]] = field(default_factory=list)
    """Per replay: collectives ``issued`` and ``served`` (and FSDP2's)."""
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Save region index -> ledger positions ``[start, end)`` it issued on forward
    (skipped on replay together with the region)."""
    _extent: Any = None
    _observer: Any = None
    _recorder: Any = None
    _starts: dict[int, int] = field(default_factory=dict)
    _keep: list[bool] = field(default_factory=list)


class _SkipFSDP:
    """Hands FSDP2's collectives straight through; the rest to ``inner``."""

    def __init__(self, inner: Any, state: LedgerState, replay: dict[str, int] | None):
        self.inner = inner
        self.state = state
        self.replay = replay

    def on_collective(self, call: CollectiveCall, issue: Callable[[], Any]) -> Any:
        if _issued_by_fsdp():
            if self.replay is None:
                self.state.fsdp_collectives += 1
            else:
                self.replay["fsdp"] += 1
            return issue()
        return self.inner.on_collective(call, issue)

    def on_extent_error(self, exc: BaseException) -> None:
        handler = getattr(self.inner, "on_extent_error", None)
        if handler is not None:
            handler(exc)


_agreements: dict[str, ReplayAgreement] = {}
_timeout = REPLAY_TIMEOUT_S


def set_replay_timeout(seconds: float) -> None:
    """Bound (seconds) for every rank to reach a replay's agreement point; past it,
    each rank raises instead of waiting. Call it on every rank before training."""
    global _timeout
    _timeout = float(seconds)
    for a in _agreements.values():
        a.timeout = _timeout


def _agreement() -> ReplayAgreement:
    import torch.distributed as dist

    world = dist.group.WORLD
    key = str(world.group_name)
    agreement = _agreements.get(key)
    if agreement is None or agreement.group is not world:
        # first use, or the process group was destroyed and created again
        agreement = _agreements[key] = ReplayAgreement(timeout=_timeout)
    return agreement


def _dist_ready() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def ledger_of(record: CheckpointRecord) -> LedgerState | None:
    """The collective ledger state of ``record`` (None without a process group)."""
    return record.extensions.get(LEDGER_KEY)


class _LedgerObserver:
    def on_checkpoint_start(self, record: CheckpointRecord, replay: bool) -> None:
        if not _dist_ready():
            return
        if not replay:
            mode = record.options["collectives"]
            state = LedgerState(CollectiveLedger(), mode)
            recorder = RecordCollectives(state.ledger, keep_outputs=mode == "save")
            state._recorder = recorder
            state._extent = observe_collectives(_SkipFSDP(recorder, state, None))
            state._extent.__enter__()
            record.extensions[LEDGER_KEY] = state
            return
        state = ledger_of(record)
        if state is None:
            return
        import torch.distributed as dist

        served = any(e.kept is not None for e in state.ledger.entries)
        cls = ServeCollectives if served else VerifyCollectives
        counts = {"issued": 0, "served": 0, "fsdp": 0}
        state.replays.append(counts)
        observer = cls(
            state.ledger, label=record.name, rank=dist.get_rank(), agreement=_agreement()
        )
        state._observer = observer
        if state.ledger:
            # Agree before anything is issued, on what this rank will replay: the
            # forward's collectives minus those of skipped save regions. Ranks that
            # decide differently (or recorded differently) all raise here.
            skipped = {i for a, b in state.spans.values() for i in range(a, b)}
            replayable = CollectiveLedger(
                [e for i, e in enumerate(state.ledger.entries) if i not in skipped]
            )
            observer._agreed = True
            observer.agreement.agree(
                record.name,
                f"{replayable.fingerprint()}/{state.ledger.fingerprint()}",
                what="the collectives to replay (forward ledger minus skipped save regions)",
            )
        state._extent = observe_collectives(_SkipFSDP(observer, state, counts))
        state._extent.__enter__()

    def on_region_start(
        self, record: CheckpointRecord | None, region: RegionRecord, replay: bool
    ) -> None:
        state = None if record is None else ledger_of(record)
        if state is None or state._extent is None:
            return
        if not replay:
            if region.is_save:
                state._starts[region.index] = len(state.ledger)
            if region.collectives is not None:
                state._keep.append(state._recorder.keep_outputs)
                state._recorder.keep_outputs = region.collectives == "save"
            return
        span = state.spans.get(region.index)
        observer = state._observer
        if span is not None and observer is not None and observer.position == span[0]:
            observer.position = span[1]  # the region is skipped: so are its collectives

    def on_region_end(
        self, record: CheckpointRecord | None, region: RegionRecord, replay: bool
    ) -> None:
        state = None if record is None else ledger_of(record)
        if state is None or state._extent is None or replay:
            return
        start = state._starts.pop(region.index, None)
        if start is not None and len(state.ledger) > start:
            state.spans[region.index] = (start, len(state.ledger))
        if region.collectives is not None:
            state._recorder.keep_outputs = state._keep.pop()

    def on_checkpoint_end(
        self, record: CheckpointRecord, replay: bool, error: BaseException | None
    ) -> None:
        state = ledger_of(record)
        if state is None or state._extent is None:
            return
        if not replay:
            state._recorder = None
        extent, state._extent = state._extent, None
        observer, state._observer = state._observer, None
        try:
            if observer is not None:
                if error is None:
                    observer.finish(complete=not record.stopped_early)
                else:
                    observer.on_extent_error(error)
        finally:
            extent.__exit__(None, None, None)
            if observer is not None:
                state.replays[-1]["issued"] = observer.issued
                state.replays[-1]["served"] = observer.served


_handle = register_observer(_LedgerObserver())
