"""The collective ledger of every checkpoint, and its verified or comm-free replay.

Attached to the core through its observer seam (``register_observer``): the core
never imports this. With a process group:

* forward: every collective issued inside the checkpoint is recorded in a
  :class:`CollectiveLedger` on the checkpoint's record (``collectives="save"`` also
  keeps their outputs), stamped with how many tensors the checkpoint had saved;
  at the forward's end the checkpoint's plan joins the pending plan of each group
  its replay is at stake on (``_step``);
* replay: the agreement of the ranks at stake runs first if this backward has not
  run it;
  then each collective is checked against the collectives this replay must issue
  *before* it is issued (``collectives="replay"``), or served from the kept
  outputs (``"save"``);
* a replay at stake that diverges or raises is absorbed: the rank releases what its
  peers wait for, the core completes the replay with stand-ins, and the report at
  the end of backward raises :class:`~remat_dist.errors.CollectiveReplayError` on
  every rank of the stake. A replay at stake nowhere, and a communication failure
  (timeout, dead peer), raise at once.

FSDP2's own all-gathers and reduce-scatters are left out of the ledger: they belong
to FSDP2's state machine (which unshards before backward reaches the block and
skips its pre-forward on recompute), not to the checkpointed function, and may
legitimately not repeat on replay. They are counted in ``fsdp_collectives``.
Without an initialised process group nothing is recorded and nothing is paid.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from remat_dist._errors import (
    AgreementSetupError,
    CollectiveReplayError,
    PlanMismatchError,
)
from remat_dist._logging import get_logger
from remat_dist._torch._checkpoint import early_stop_enabled
from remat_dist.core import CheckpointRecord, RegionRecord, register_observer
from remat_dist.distributed import _step
from remat_dist.distributed._intercept import (
    CollectiveCall,
    ObserverExtent,
    issued_by_fsdp,
)
from remat_dist.distributed._ledger import CollectiveEntry, CollectiveLedger
from remat_dist.distributed._ready import dist_ready
from remat_dist.distributed._verify import (
    RecordCollectives,
    ServeCollectives,
    VerifyCollectives,
    is_comm_failure,
)

__all__ = ["LEDGER_KEY", "LedgerState", "ledger_of", "plan_of"]

log = get_logger(__name__)

_NO_GROUPS: dict[str, str] = {}
_NO_COLLECTIVES = CollectiveLedger()
"""The ledger of a forward that issued no collective of its own (shared, never
appended to: :meth:`LedgerState.on_collective` makes a ledger first)."""

_EMPTY_SET: frozenset[Any] = frozenset()
_EMPTY_MAP: Mapping[Any, Any] = MappingProxyType({})
_EMPTY_LIST: tuple[Any, ...] = ()

LEDGER_KEY = "remat_dist.collectives"
"""``record.extensions`` key of a checkpoint's :class:`LedgerState`."""


class LedgerState:
    """What one checkpoint knows of its collectives (``record.extensions``), and
    the observer of its forward's collectives: FSDP2's own are counted and pass,
    the rest are recorded in :attr:`ledger` (the recorder is made at the first).

    One is made per checkpoint call, and most forwards issue no collective of
    their own: the containers below start as shared empty ones and are made when
    first written.

    Attributes:
        ledger: the forward's collectives (a shared empty ledger until the first).
        mode: the checkpoint's ``collectives`` option (None: the default).
        early_stop: whether torch's checkpoint stops the replay at the last saved
            tensor.
        fsdp_collectives: FSDP2 collectives issued inside the forward (not in the
            ledger).
        fsdp_stakes: the ranks of the groups of those FSDP2 collectives (the
            checkpoint contains an FSDP unit: FSDP's group is at stake too).
        stakes: the ranks of every group this checkpoint's replay is at stake on
            (set at the forward's end).
        replays: per replay, collectives ``issued`` and ``served`` (and FSDP2's).
        spans: save region index -> ledger positions ``[start, end)`` it issued on
            forward (skipped on replay together with the region).
        keep_outputs: whether the forward's collectives now keep their outputs
            (``"save"``).
    """

    __slots__ = (
        "ledger",
        "mode",
        "early_stop",
        "fsdp_collectives",
        "fsdp_stakes",
        "stakes",
        "replays",
        "spans",
        "keep_outputs",
        "_extent",
        "_observer",
        "_recorder",
        "_step",
        "_meta",
        "_starts",
        "_keep",
    )

    def __init__(
        self, ledger: CollectiveLedger, mode: str | None, early_stop: bool = True
    ) -> None:
        self.ledger = ledger
        self.mode = mode
        self.early_stop = early_stop
        self.fsdp_collectives = 0
        self.fsdp_stakes: frozenset[tuple[int, ...]] | set[tuple[int, ...]] = _EMPTY_SET
        self.stakes: tuple[tuple[int, ...], ...] = ()
        self.replays: list[dict[str, int]] = _EMPTY_LIST  # type: ignore[assignment]
        self.spans: dict[int, tuple[int, int]] = _EMPTY_MAP  # type: ignore[assignment]
        self.keep_outputs = mode == "save"
        self._extent: ObserverExtent | None = None
        """The observer routing this checkpoint's collectives while its forward or
        a replay runs: pushed by ``on_checkpoint_start``, popped by
        ``on_checkpoint_end`` (the core calls both, the end also when it raises)."""
        self._observer: Any = None
        self._recorder: RecordCollectives | None = None
        self._step: Any = None
        """The step state its forward started in (``_step.StepState``)."""
        self._meta: Sequence[Any] = _EMPTY_LIST
        """The checkpoint's saved-tensor metadata: its length is how many tensors
        it has saved so far (stamped on entries)."""
        self._starts: dict[int, int] = _EMPTY_MAP  # type: ignore[assignment]
        self._keep: list[bool] = _EMPTY_LIST  # type: ignore[assignment]

    def on_collective(self, call: CollectiveCall, issue: Callable[[], Any]) -> Any:
        if issued_by_fsdp():
            self.fsdp_collectives += 1
            if self.fsdp_stakes is _EMPTY_SET:
                self.fsdp_stakes = set()
            self.fsdp_stakes.add(call.group.ranks)
            return issue()
        recorder = self._recorder
        if recorder is None:
            if self.ledger is _NO_COLLECTIVES:
                self.ledger = CollectiveLedger()
            recorder = self._recorder = RecordCollectives(
                self.ledger, packs=self._meta.__len__
            )
        recorder.keep_outputs = self.keep_outputs
        return recorder.on_collective(call, issue)

    def kept_tensors(self) -> list[tuple[str, Any]]:
        """The collective outputs kept for comm-free replay (``RecordExtension``:
        reports count them)."""
        return [
            (f"{e.op} #{e.position} output (kept for comm-free replay)", t)
            for e in self.ledger.entries
            if e.kept is not None
            for t in e.kept
        ]

    def replay_plan(self, forward_packs: int) -> list[CollectiveEntry]:
        """The collectives a replay issues, in order: the forward's, minus those of
        skipped save regions, up to torch's early stop at the last saved tensor."""
        skipped = {i for a, b in self.spans.values() for i in range(a, b)}
        return [
            e
            for i, e in enumerate(self.ledger.entries)
            if i not in skipped
            and (
                not self.early_stop
                or e.packs_before < 0
                or e.packs_before < forward_packs
            )
        ]


class _SkipFSDP:
    """A replay's observer: hands FSDP2's collectives straight through (counted),
    the rest to ``inner``."""

    __slots__ = ("inner", "counts")

    def __init__(self, inner: Any, counts: dict[str, int]):
        self.inner = inner
        self.counts = counts

    def on_collective(self, call: CollectiveCall, issue: Callable[[], Any]) -> Any:
        if issued_by_fsdp():
            self.counts["fsdp"] += 1
            return issue()
        return self.inner.on_collective(call, issue)


def stakes_of(state: LedgerState) -> dict[tuple[int, ...], dict[str, str]]:
    """The ranks at stake on a checkpoint's replay, each with the fingerprints (per
    process group over those ranks) that they compare: every group of its forward
    ledger but point-to-point, and FSDP's groups when it contains an FSDP unit."""
    ranks_of = {
        f"{e.group_name}/{len(e.group_ranks)}": tuple(sorted(e.group_ranks))
        for e in state.ledger.entries
    }
    out: dict[tuple[int, ...], dict[str, str]] = {}
    for key, fp in state.ledger.group_fingerprints().items():
        out.setdefault(ranks_of[key], {})[key] = fp
    for ranks in state.fsdp_stakes:
        out.setdefault(tuple(sorted(ranks)), {})
    return out


def ledger_of(record: CheckpointRecord) -> LedgerState | None:
    """The collective ledger state of ``record`` (None without a process group)."""
    return record.extensions.get(LEDGER_KEY)


def plan_of(record: CheckpointRecord) -> tuple[Any, ...]:
    """One checkpoint's plan entry: its name, collective mode, and each region's
    decision and collective mode (regions nested in save regions never replay).
    Hashable, so that a digest can reuse the encoding of an entry it has seen."""
    mode = record.options.get("collectives")
    return (
        record.name,
        mode,
        tuple(
            (
                r.local_name,
                "recompute" if r.recompute else "save",
                r.options.get("collectives") or mode,
            )
            for r in record.regions
            if not r.inside_save
        ),
    )


def _verifier(
    record: CheckpointRecord, state: LedgerState, expected: list[CollectiveEntry]
) -> VerifyCollectives:
    """What checks (or serves) the collectives of one replay of ``record``."""
    served = any(e.kept is not None for e in expected)
    cls = ServeCollectives if served else VerifyCollectives
    return cls(
        expected,
        label=record.name,
        rank=_step.current_step().rank,
        op_timeout=_step.replay_timeout(),
        forward_total=len(state.ledger),
    )


class _QuietReplay:
    """The observer of a replay whose forward issued no collective of its own (the
    common case under FSDP2): FSDP2's collectives pass and are counted; any other
    one goes to a verifier made on the spot, which refuses it as its forward never
    issued it."""

    __slots__ = ("record", "state", "counts", "verifier")

    def __init__(
        self, record: CheckpointRecord, state: LedgerState, counts: dict[str, int]
    ) -> None:
        self.record = record
        self.state = state
        self.counts = counts
        self.verifier: VerifyCollectives | None = None

    def on_collective(self, call: CollectiveCall, issue: Callable[[], Any]) -> Any:
        if issued_by_fsdp():
            self.counts["fsdp"] += 1
            return issue()
        if self.verifier is None:
            self.verifier = _verifier(self.record, self.state, [])
        return self.verifier.on_collective(call, issue)


class _LedgerObserver:
    def on_checkpoint_start(self, record: CheckpointRecord, replay: bool) -> None:
        if not replay:
            step = _step.checkpoint_forward_starts()
            if step is None:  # no process group
                return
            # the ledger is made at the first collective (most forwards issue none)
            state = LedgerState(
                _NO_COLLECTIVES,
                record.options.extensions.get("collectives"),
                early_stop_enabled(),
            )
            state._meta = record.saved_meta
            state._step = step
            state._extent = ObserverExtent(state, checked=True)
            record.extensions[LEDGER_KEY] = state
            return
        state = record.extensions.get(LEDGER_KEY)
        if state is None:
            return
        quiet = not state.ledger.entries and not state.stakes
        if not quiet and not dist_ready():
            return
        counts = {"issued": 0, "served": 0, "fsdp": 0}
        if state.replays is _EMPTY_LIST:
            state.replays = []
        state.replays.append(counts)
        if quiet:
            # its forward issued no collective but FSDP2's own outside any FSDP
            # group at stake (checkpointing inside FSDP2's units): nothing to agree
            # on or verify; a collective this replay issues anyway is refused
            if log.isEnabledFor(20):  # INFO
                _step.current_step().announce_nothing_at_stake(record.name)
            state._observer = _QuietReplay(record, state, counts)
            state._extent = ObserverExtent(state._observer, checked=True)
            return
        if state.stakes:
            _step.current_step().replay_starts(state.stakes)
        # else: at stake nowhere (point-to-point only): no agreement to join here;
        # the verifier below still checks each collective before it is issued
        expected = state.replay_plan(len(record.saved_meta))
        if log.isEnabledFor(10):  # DEBUG
            log.debug(
                "replay of '%s': %d of the forward's %d collectives (%d served)%s",
                record.name,
                len(expected),
                len(state.ledger),
                sum(e.kept is not None for e in expected),
                "".join(f"\n  #{e.position}: {e.describe()}" for e in expected),
            )
        state._observer = _verifier(record, state, expected)
        state._extent = ObserverExtent(_SkipFSDP(state._observer, counts), checked=True)

    def on_region_start(
        self, record: CheckpointRecord | None, region: RegionRecord, replay: bool
    ) -> None:
        state = None if record is None else ledger_of(record)
        if state is None or state._extent is None or replay:
            return
        if region.is_save:
            if state._starts is _EMPTY_MAP:
                state._starts = {}
            state._starts[region.index] = len(state.ledger)
        mode = region.options.get("collectives")
        if mode is not None:
            if state._keep is _EMPTY_LIST:
                state._keep = []
            state._keep.append(state.keep_outputs)
            state.keep_outputs = mode == "save"

    def on_region_end(
        self, record: CheckpointRecord | None, region: RegionRecord, replay: bool
    ) -> None:
        state = None if record is None else ledger_of(record)
        if state is None or state._extent is None or replay:
            return
        start = state._starts.pop(region.index, None) if state._starts else None
        if start is not None and len(state.ledger) > start:
            if state.spans is _EMPTY_MAP:
                state.spans = {}
            state.spans[region.index] = (start, len(state.ledger))
        if region.options.get("collectives") is not None:
            state.keep_outputs = state._keep.pop()

    def on_replay_error(self, record: CheckpointRecord, error: BaseException) -> bool:
        state = ledger_of(record)
        observer = None if state is None else state._observer
        if isinstance(observer, _QuietReplay):
            observer = observer.verifier
        if observer is None or not state.stakes or is_comm_failure(error):
            # nothing at stake: no peer waits on this replay; raise as torch does
            return False
        if isinstance(error, (PlanMismatchError, AgreementSetupError)):
            # the agreement posted at this replay's start failed, before its
            # first collective, on every rank of the stake: all of them raise
            return False
        message = observer.fail(error)
        log.warning(
            "replay of '%s' failed here; its peers were released and every rank "
            "raises at backward's end: %s",
            record.name,
            message,
        )
        _step.current_step().fail(message)
        return True

    def on_checkpoint_end(
        self, record: CheckpointRecord, replay: bool, error: BaseException | None
    ) -> None:
        state = record.extensions.get(LEDGER_KEY)
        if state is None or state._extent is None:
            return
        extent, state._extent = state._extent, None
        observer, state._observer = state._observer, None
        extent.pop()
        if not replay:
            state._recorder = None
            step, state._step = state._step, None  # holds the process group
            if error is None:
                if not state.ledger.entries and not state.fsdp_stakes:
                    # at stake nowhere: its plan joins only the step's full plan
                    entry = (
                        plan_of(record)
                        if record.regions
                        else (record.name, state.mode, ())
                    )
                    step.full.add(entry, _NO_GROUPS)
                    return
                by_stake = stakes_of(state)
                state.stakes = tuple(sorted(by_stake))
                _step.current_step().add_checkpoint(record, plan_of(record), by_stake)
            return
        if isinstance(observer, _QuietReplay):
            observer = observer.verifier
            if observer is None:  # issued nothing of its own, as its forward
                return
        counts = state.replays[-1]
        counts["issued"], counts["served"] = observer.issued, observer.served
        if error is None and observer.failure is None:
            failure = observer.finish()
            if failure is not None:
                if not state.stakes:
                    raise CollectiveReplayError(failure)
                _step.current_step().fail(failure)


_handle = register_observer(_LedgerObserver())
