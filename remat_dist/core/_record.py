"""The per-checkpoint record and the observer seam.

One checkpoint call produces one :class:`CheckpointRecord` on forward: its name, the
ordered regions with their decisions, the save regions' saved-tensor entries and
persisted outputs, and the state-hook snapshots. Replay walks the same record, and
reports read it. The record lives exactly as long as the checkpoint's autograd graph
(torch's checkpoint frame owns the replay closure that owns the record), so nothing
saved outlives its backward.

Layers above the core (the distributed ledger, traces) attach through
:func:`register_observer` (``_observers.py``), into the seam kept here; the core
never imports them.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from remat_dist.core._arg_names import ArgumentNames, argument_name
from remat_dist.core._options import CheckpointOptions
from remat_dist.core._storage import TensorMeta, plain
from remat_dist.core._types import RecomputeStateHook

__all__ = [
    "CheckpointObserver",
    "CheckpointPhase",
    "CheckpointRecord",
    "PersistedOutput",
    "RecordExtension",
    "RegionRecord",
    "SavedEntry",
    "WeakRecords",
    "saved_entry",
    "live_records",
    "set_default_state_hooks_provider",
]


@dataclass
class SavedEntry:
    """One tensor a save region keeps for backward (metadata only, for reports)."""

    name: str | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    storage: tuple[Any, int]
    storage_nbytes: int
    nbytes: int
    is_parameter: bool
    packed_by_user_hook: bool


@dataclass
class PersistedOutput:
    """A save region's output kept so that replay can feed later code with it.

    ``packed`` is what the user's pack hook returned (or the tensor itself);
    ``free`` marks an output that backward keeps anyway (no extra bytes).
    """

    packed: Any
    unpack: Callable[[Any], torch.Tensor] | None
    version: int
    nbytes: int
    free: bool

    def get(self) -> torch.Tensor:
        return self.packed if self.unpack is None else self.unpack(self.packed)


@dataclass
class RegionRecord:
    """One region call inside a checkpoint, in forward order (pre-order)."""

    name: str
    """Qualified name, ``checkpoint::prefix/name``."""
    local_name: str
    recompute: bool
    index: int
    parent: int | None
    inside_save: bool
    """True for a region nested in a save region: it never runs on replay."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """The region's declared options (``core.declare_option``); a None value means
    the checkpoint's applies."""
    descendants: int = 0
    outputs: list[torch.Tensor | None] = field(default_factory=list)
    """Forward outputs (strong refs only while the forward runs)."""
    output_hooks: Any = None
    """The user's saved-tensor hooks where a save region returned, and the context
    they captured there (``output_context``): a consumer that persists an output
    later packs it with these (only while the forward runs)."""
    output_context: Any = None
    output_meta: list[TensorMeta | None] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    output_structure: str = "tensor"
    """``tensor``, ``tuple`` or ``list``: how replay rebuilds the return value."""
    persisted: dict[int, PersistedOutput] = field(default_factory=dict)
    released: set[int] = field(default_factory=set)
    """Outputs whose persisted value a replay dropped: one in the last backward
    that can replay the checkpoint (``CheckpointRecord.frees_graph``), which
    reads each once, as torch's checkpoint does."""
    saved: list[SavedEntry] = field(default_factory=list)
    routed: list[tuple[Any, ...]] = field(default_factory=list)
    """Saves that are (views of) the region's own inputs: not kept, recomputed by
    torch's checkpoint with the rest (``(arg index, arg shape, arg strides, shape,
    strides, offset from the arg)``, in pack order)."""
    state_after: tuple[Any, ...] | None = None
    saved_span: tuple[int, int] | None = None
    """``[first, end)`` of the indices torch's checkpoint gave the tensors this
    region's forward saved (``record.saved_meta``): what names the region in a
    replay's mismatch error."""

    @property
    def is_save(self) -> bool:
        return not self.recompute and not self.inside_save


def saved_entry(
    t: torch.Tensor, name: str | None, *, packed_by_user_hook: bool = False
) -> SavedEntry:
    """Report metadata of a tensor the checkpoint keeps (an input, a region save)."""
    local = plain(t)
    storage = local.untyped_storage()
    return SavedEntry(
        name=name,
        shape=tuple(t.shape),
        dtype=t.dtype,
        device=local.device,
        storage=(local.device, storage._cdata),
        storage_nbytes=storage.nbytes(),
        nbytes=local.numel() * local.element_size(),
        is_parameter=_of_parameter(t),
        packed_by_user_hook=packed_by_user_hook,
    )


def _of_parameter(t: torch.Tensor) -> bool:
    """``t`` is an ``nn.Parameter`` or a view of one (``linear`` saves ``weight.t()``):
    its bytes belong to the model, not to the activations."""
    for _ in range(16):
        if isinstance(t, torch.nn.Parameter):
            return True
        base = t._base
        if base is None:
            return False
        t = base
    return False



class CheckpointPhase(enum.Enum):
    """Where one checkpoint is in its life (``record.phase``)."""

    FORWARD = "forward"
    """The checkpointed function runs for the first time."""
    WAITING = "waiting"
    """Forward done; backward has not replayed it (yet)."""
    REPLAYING = "replaying"
    REPLAYED = "replayed"
    """The last replay ran to the function's end."""
    STOPPED_EARLY = "stopped early"
    """torch's early stop ended the last replay: backward had all it needed."""
    REPLAY_FAILED = "replay failed"
    """The last replay raised; if an observer absorbed the error, backward went on
    with stand-ins."""


_DONE = (CheckpointPhase.REPLAYED, CheckpointPhase.STOPPED_EARLY)
"""The phases of a replay that ran to its end or that torch stopped early."""


class CheckpointRecord:
    """Everything one checkpoint call knows, forward and replay.

    Attributes (read by replay and reports):
        name: the checkpoint's region name.
        regions: the region calls of the forward, in order.
        state_hooks: the :class:`RecomputeStateHook` set in force.
        entry_state: the hooks' snapshots at checkpoint entry.
        input_entries: metadata of the tensor arguments (kept by torch's frame),
            named by the checkpointed function's parameters (:meth:`input_name`).
        options: the frozen :class:`CheckpointOptions` (declared options of the
            layers above in ``options.extensions``).
        extensions: per-observer data (the distributed ledger lives here).
        phase: the :class:`CheckpointPhase`; ``replaying`` and ``forward_done``
            read it. Only the record's own methods change the state of a phase
            (the regions running, the replay's position, the names taken, the
            save regions' outputs by storage): ``start_replay``, ``end_replay``,
            ``end_forward`` and the region methods.
        replay_packs: saved tensors the current replay has recomputed so far.
        saved_meta: shape, dtype, device and strides (and a tensor subclass's
            structure) of every tensor torch's checkpoint saved on forward, in
            order; each replay is checked against it (``_replay_check``), and a
            failed replay an observer absorbs is completed with stand-ins built
            from it (``_standin``).
    """

    __slots__ = (
        "name",
        "regions",
        "state_hooks",
        "entry_state",
        "_input_entries",
        "_inputs",
        "_arg_fn",
        "_arg_first",
        "_arg_counts",
        "options",
        "extensions",
        "phase",
        "replay_count",
        "replay_packs",
        "saved_meta",
        "saved_specs",
        "values_check",
        "forward_graph",
        "frees_graph",
        "_cursor",
        "_stack",
        "_names",
        "_producers",
        "__weakref__",
    )

    def __init__(
        self,
        name: str,
        state_hooks: Sequence[RecomputeStateHook],
        options: CheckpointOptions,
    ) -> None:
        self.name = name
        self.regions: list[RegionRecord] = []
        self.state_hooks = tuple(state_hooks)
        self.entry_state: tuple[Any, ...] = ()
        self._input_entries: list[SavedEntry] | None = None
        self._inputs: Sequence[tuple[int, Any]] = ()
        self._arg_fn: Callable[..., Any] | None = None
        self._arg_first = 0
        self._arg_counts: tuple[int, tuple[str, ...]] = (0, ())
        """What names the inputs (``ArgumentNames``' fields, kept apart: a call
        sets them and reports alone make the names)."""
        self.options = options
        self.extensions: dict[str, Any] = {}
        self.phase = CheckpointPhase.FORWARD
        self.replay_count = 0
        self.replay_packs = 0
        self.saved_meta: Sequence[tuple[Any, ...]] = ()
        """torch's frame's list of what the forward saved (``_standin.note_forward``)."""
        self.saved_specs: Sequence[tuple[Any, ...]] | None = None
        """Full metadata of an earlier forward of the same call site that saved the
        same kinds of tensors, where ``saved_meta`` is the plain metadata of a
        forward that saved tensor subclasses (``_standin.SaveSite``)."""
        self.values_check = False
        """Whether this checkpoint's replay compares values (decided at its
        forward: ``values_check_enabled``)."""
        self.forward_graph: Any = None
        """What the forward noted of its nodes when it persisted a save-region
        output (``_save_region.ForwardGraph``), else None."""
        self.frees_graph = False
        """Whether the running (or last) replay's backward is the last that can
        replay this checkpoint (``_save_region.replay_frees_graph``): its replay
        drops the persisted outputs."""
        self._cursor = 0
        self._stack: list[RegionRecord] = []
        self._names: set[str] = set()
        self._producers: dict[tuple[Any, int], tuple[RegionRecord, int]] = {}
        _live.add(self)

    @property
    def input_entries(self) -> list[SavedEntry]:
        """Report metadata of the tensor arguments, each named by its parameter
        (:meth:`input_name`), taken on first read (reports read it while the
        graph, and so torch's frame holding the inputs, lives)."""
        entries = self._input_entries
        if entries is None:
            entries = self._input_entries = []
            for i, held in self._inputs:
                if isinstance(held, SavedEntry):
                    entry = held
                elif (t := held()) is not None:
                    entry = saved_entry(t, None)
                else:
                    continue
                entry.name = self.input_name(i)
                entries.append(entry)
            self._inputs = ()
        return entries

    def input_name(self, index: int) -> str:
        """The name of the checkpoint's argument ``index`` (its positional
        arguments, then its keyword arguments): the parameter of the checkpointed
        function it binds to (``hidden_states``; ``args[0]`` for an entry of
        ``*args``), its keyword, or ``input {index}`` where no signature names it."""
        names = ArgumentNames(self._arg_fn, self._arg_first, *self._arg_counts)
        return argument_name(names, index)

    def name_inputs_by(self, fn: Callable[..., Any], first: int = 0) -> None:
        """Name the inputs after ``fn``'s parameters instead of the checkpointed
        function's: argument ``i`` of the checkpoint is ``fn``'s positional
        argument ``i - first`` (a generic runner that receives the module first
        names them by the module's ``forward``)."""
        self._arg_fn = fn
        self._arg_first = first

    def note_inputs(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        *,
        hooked: bool = False,
    ) -> None:
        """Remember the tensor arguments of a call of ``fn`` for
        :attr:`input_entries`. Weakly, their entries taken when a report reads
        them: torch's frame keeps them alive as long as the checkpoint's graph.
        Under the user's saved-tensor hooks (``hooked``) the entries are taken now:
        what the hook packs may be the only copy left, and the positional ones are
        marked as packed by it. Only the counts and keywords of the call are kept
        for the names, which are made on first read."""
        self._arg_fn = fn
        self._arg_first = 0
        self._arg_counts = (len(args), tuple(kwargs) if kwargs else ())
        if hooked:
            self._inputs = [
                (i, saved_entry(t, None, packed_by_user_hook=i < len(args)))
                for i, t in enumerate((*args, *kwargs.values()))
                if isinstance(t, torch.Tensor)
            ]
            return
        inputs = self._inputs = []
        for i, t in enumerate((*args, *kwargs.values()) if kwargs else args):
            if isinstance(t, _Tensor):
                inputs.append((i, _weak(t)))

    @property
    def replaying(self) -> bool:
        return self.phase is CheckpointPhase.REPLAYING

    @property
    def forward_done(self) -> bool:
        return self.phase is not CheckpointPhase.FORWARD

    # -- phases: the only writers of the walk's state below

    def start_replay(self) -> bool:
        """A replay begins: the region walk starts over at the first region.
        Returns whether the forward had ended (False: a backward inside the
        forward replays a forward still running)."""
        forward_done = self.phase is not CheckpointPhase.FORWARD
        self.phase = CheckpointPhase.REPLAYING
        self._cursor = 0
        self.replay_count += 1
        return forward_done

    def end_replay(self, phase: CheckpointPhase) -> None:
        """A replay ended in ``phase``. After one that ran to its end or stopped
        early in the last backward that can replay the checkpoint
        (:attr:`frees_graph`), its persisted outputs go (:meth:`release_persisted`)."""
        self.phase = phase
        if self.frees_graph and phase in _DONE:
            self.release_persisted()
        self._stack.clear()

    def end_forward(self) -> None:
        """The forward ended: drop what only the forward needs (the outputs its
        save regions returned, their hooks, who produced which storage, the names
        taken), so the record keeps no tensor the graph does not keep."""
        self.phase = CheckpointPhase.WAITING
        for r in self.regions:
            r.outputs = []
            r.output_hooks = r.output_context = None
        self._producers.clear()
        self._names.clear()
        self._stack.clear()

    # -- the regions running now (forward and replay)

    def current_region(self) -> RegionRecord | None:
        """The innermost region running now, or None outside every region."""
        stack = self._stack
        return stack[-1] if stack else None

    def enter_region(self, rr: RegionRecord) -> None:
        """``rr`` starts running (inside the current one)."""
        self._stack.append(rr)

    def leave_region(self) -> None:
        """The innermost running region returned (or raised)."""
        self._stack.pop()

    def claim_name(self, qualified: str) -> bool:
        """Take a region's qualified name for this forward; False when a region
        of the forward already took it."""
        names = self._names
        if qualified in names:
            return False
        names.add(qualified)
        return True

    # -- the forward's save-region outputs, by storage

    def has_producers(self) -> bool:
        """Whether a save region of this forward returned a tensor not kept anyway."""
        return bool(self._producers)

    def producer_of(self, key: tuple[Any, int]) -> tuple[RegionRecord, int] | None:
        """``(save region, output index)`` that produced storage ``key``, if any."""
        return self._producers.get(key)

    def note_producer(self, key: tuple[Any, int], rr: RegionRecord, index: int) -> None:
        """Output ``index`` of save region ``rr`` lives in storage ``key`` (the
        first producer of a storage keeps it)."""
        self._producers.setdefault(key, (rr, index))

    # -- the replay's walk over the forward's regions

    def next_region(self) -> RegionRecord | None:
        """The region the forward ran next at the replay's position, or None
        past the last."""
        cursor = self._cursor
        regions = self.regions
        return regions[cursor] if cursor < len(regions) else None

    def advance(self, count: int) -> None:
        """Move the replay's position ``count`` regions on (a skipped save
        region passes its nested regions too)."""
        self._cursor += count

    def release_persisted(self) -> None:
        """Drop every persisted output left after a replay in the last backward
        that can replay this checkpoint (:attr:`frees_graph`): the regions after
        torch's early stop are never served in it, and no later backward replays."""
        for r in self.regions:
            r.released.update(r.persisted)
            r.persisted.clear()

    def __repr__(self) -> str:
        decisions = ", ".join(
            f"{r.local_name}:{'recompute' if r.recompute else 'save'}"
            for r in self.regions
        )
        return f"CheckpointRecord({self.name!r}, [{decisions}])"


_weak = weakref.ref
_Tensor = torch.Tensor


class WeakRecords:
    """Records held weakly, cheap to add to (one weak reference per record, no
    callback on its death: adding runs once per checkpoint call). Dead references
    are dropped as the list doubles and on every read."""

    __slots__ = ("_refs", "_limit")

    def __init__(self) -> None:
        self._refs: list[weakref.ref[CheckpointRecord]] = []
        self._limit = 64

    def add(self, record: CheckpointRecord) -> None:
        refs = self._refs
        refs.append(weakref.ref(record))
        if len(refs) > self._limit:
            self.alive()

    def alive(self) -> list[CheckpointRecord]:
        """The records still alive, in the order they were added."""
        out = [r for ref in self._refs if (r := ref()) is not None]
        self._refs = [weakref.ref(r) for r in out]
        self._limit = max(64, 2 * len(out))
        return out

    def __iter__(self) -> Iterator[CheckpointRecord]:
        return iter(self.alive())

    def __len__(self) -> int:
        return len(self.alive())


_live = WeakRecords()


def live_records() -> list[CheckpointRecord]:
    """Every record whose autograd graph is still alive (weakly tracked)."""
    return _live.alive()


class RecordExtension(Protocol):
    """What a layer above may keep on a record (``record.extensions[key]``) and
    must let reports count: every report sums :meth:`kept_tensors`."""

    def kept_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(label, tensor)`` for each tensor this extension keeps alive for the
        checkpoint's backward (e.g. collective outputs served on replay)."""
        ...


class CheckpointObserver(Protocol):
    """Notified at phase and region boundaries of every checkpoint.

    Methods may be left out; only those present are called. ``replay`` is False on
    forward. An observer whose class sets ``values_check_only = True`` gets its
    checkpoint start and end calls only for checkpoints whose value check is on
    (``record.values_check``). A region called outside any checkpoint (a plain call) is announced
    with ``record=None``. Observers must not raise except to report a real error (the error then
    propagates to the user's forward or backward).
    """

    def on_checkpoint_start(self, record: CheckpointRecord, replay: bool) -> None: ...

    def on_checkpoint_end(
        self, record: CheckpointRecord, replay: bool, error: BaseException | None
    ) -> None: ...

    def on_region_start(
        self, record: CheckpointRecord | None, region: RegionRecord, replay: bool
    ) -> None: ...

    def on_region_end(
        self, record: CheckpointRecord | None, region: RegionRecord, replay: bool
    ) -> None: ...

    def on_replay_error(self, record: CheckpointRecord, error: BaseException) -> bool:
        """A replay raised ``error``. Return True to absorb it: the core completes
        the replay with stand-ins (from ``record.saved_meta``) and backward goes
        on with wrong values, so the observer must make the step fail later."""
        ...


@dataclass
class _Seams:
    """What the layers above attached to the core at their import: the observers
    (``register_observer``) and the default state hooks' provider. Registrations,
    not state: they last as long as the process (a handle's ``remove()`` undoes
    one observer)."""

    observers: list[Any] = field(default_factory=list)
    hooks_provider: Callable[[], tuple[RecomputeStateHook, ...]] = tuple
    """What ``checkpoint`` calls for its state hooks when the caller passes none
    (:func:`set_default_state_hooks_provider`; ``tuple``: none)."""
    hooks_extent: Callable[[], Any] | None = None
    """Opened while a ``saved_tensors_hooks`` pair is installed as torch's hooks
    (:func:`set_saved_hooks_extent`); returns an object with ``pop()``."""
    starts: tuple[tuple[Callable[..., Any], ...], ...] = ((), ())
    """The observers' ``on_checkpoint_start`` methods in order, without and with
    the ``values_check_only`` ones (indexed by ``record.values_check``; called
    twice per checkpoint call, so kept ready rather than looked up each time)."""
    ends: tuple[tuple[Callable[..., Any], ...], ...] = ((), ())
    """Their ``on_checkpoint_end`` methods, the same way."""

    def refresh(self) -> None:
        self.starts = _methods(self.observers, "on_checkpoint_start")
        self.ends = _methods(self.observers, "on_checkpoint_end")


def _methods(
    observers: list[Any], event: str
) -> tuple[tuple[Callable[..., Any], ...], ...]:
    every = [(getattr(o, event, None), getattr(o, "values_check_only", False)) for o in observers]
    return (
        tuple(m for m, only in every if m is not None and not only),
        tuple(m for m, _ in every if m is not None),
    )


_SEAMS = _Seams()


def absorbs(record: CheckpointRecord, error: BaseException) -> bool:
    """Whether an observer absorbs ``error`` raised in ``record``'s replay."""
    absorbed = False
    for obs in tuple(_SEAMS.observers):
        method = getattr(obs, "on_replay_error", None)
        if method is not None and method(record, error):
            absorbed = True
    return absorbed


def notify(event: str, *args: Any) -> None:
    for obs in tuple(_SEAMS.observers):
        method = getattr(obs, event, None)
        if method is not None:
            method(*args)


def set_default_state_hooks_provider(
    provider: Callable[[], tuple[RecomputeStateHook, ...]] | None,
) -> None:
    """Set what ``checkpoint`` uses when the caller passes no state hooks.

    The distributed layer installs one that returns the per-rank RNG hooks when a
    process group exists; the core alone uses none (torch_remat's behaviour).
    """
    _SEAMS.hooks_provider = tuple if provider is None else provider


def set_saved_hooks_extent(opener: Callable[[], Any] | None) -> None:
    """Set what runs around the extent of a :class:`saved_tensors_hooks` pair that
    is installed as torch's hooks (outside a checkpoint): ``opener()`` at its
    ``__enter__``, and ``pop()`` of what it returned at its ``__exit__``.

    The distributed layer installs one that issues the extent's collectives
    without the saved-tensor hooks: a backend's work captures the caller's thread
    state, and Python hooks in it make the work's thread need the GIL (an abort
    when that happens at interpreter exit).
    """
    _SEAMS.hooks_extent = opener
