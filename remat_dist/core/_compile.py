"""The ``torch.compile`` path of ``checkpoint``, ``region``, ``name_scope`` and friends.

Eager remat drives torch's non-reentrant checkpoint through ``context_fn`` and keeps
its state (the running checkpoint, its record, the name prefix) in ``contextvars``,
which Dynamo cannot trace. Under ``torch.compile`` nothing of that runs: the entry
points ask :func:`compiling` first and come here, where the same semantics are
expressed in what the compiler understands.

* A checkpoint is ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` with a
  selective-checkpoint ``context_fn`` (:func:`_sac_contexts`). Dynamo turns it into
  one activation-checkpoint region of the graph; AOTAutograd calls
  :func:`_policy` once per ATen op of the region and tags the op's node with the
  answer, and the min-cut partitioner obeys the tags.
* The body of a checkpoint and each region run under
  ``torch.fx.traceback.annotate``: every node they produce carries
  ``node.meta["custom"]["remat_dist"] = "recompute" | "save"`` (the innermost
  annotation wins), which is what :func:`_policy` reads. Ops of a save region are
  ``MUST_SAVE`` (the partitioner keeps whatever of theirs backward or a recompute
  needs, the eager save region's keep-what-it-saves); every other op of the
  checkpoint is ``MUST_RECOMPUTE`` (the eager "everything recomputes"), except
  collectives (``_c10d_functional``), which are always ``MUST_SAVE`` so that the
  compiled backward never issues a collective the model without remat would not.
* Random ops stay ``MUST_RECOMPUTE``: AOTAutograd stashes the generator state
  before each recomputed random op and replays it in backward, so dropout masks
  equal the forward's (the compiler's counterpart of the recompute state hooks,
  which therefore are not called under compile). In a graph that takes opaque
  objects (DTensor's ``DeviceMesh``: tensor parallelism) they are ``MUST_SAVE``
  instead, working around a torch 2.13 partitioner bug (:func:`_has_opaque_inputs`).
* What the eager path checks through its record is checked at trace time from the
  annotations (:func:`_enclosing`): a checkpoint inside a checkpoint, a recompute
  region inside a save region. Options that cannot work in a compiled graph raise
  :class:`RematUsageError` at trace time, naming the option and the fix.

``is_recomputing()`` is False while compiling: Dynamo traces the forward only, and
the compiled backward recomputes graph ops, never Python.

Two ways the checkpoint runs without a traced graph, where no annotation can help:

* A graph break inside the body (``fullgraph=False``): Dynamo gives up on the
  activation-checkpoint region and calls ``torch.utils.checkpoint`` eagerly (with
  Dynamo disabled inside) on ``body``. ``body`` sees it is not compiling and keeps
  a runtime stack instead (:data:`_fallback`: checkpoint name, mode, region name);
  regions entered with no eager frame push onto it (:func:`fallback_region_call`),
  :func:`_policy` reads it, and an eager checkpoint entered under it is refused as
  nested. Torch's selective checkpoint then keeps the save regions' op outputs, as
  the partitioner does in a graph.
* ``backend="eager"`` (no AOTAutograd): the higher-order op runs the traced
  subgraph under torch's checkpoint at run time through an ``fx.Interpreter`` that
  restores each node's metadata, so :func:`_policy` reads the annotations then as
  at trace time (and refuses an op without one, rather than recompute a save
  region). It passes ``preserve_rng_state=False`` (torch counts on AOTAutograd to
  replay generator states), so the run-time contexts of :func:`_sac_contexts`
  restore them.

In both, a save region's in-place ops are recomputed (``_compile_runtime.mutated_at_runtime``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy

from remat_dist._errors import RematUsageError
from remat_dist._torch._checkpoint import (
    CHECKPOINT_EXITS_ON_ERROR,
    exit_left_checkpoints,
    sac_bypasses_saved_tensor_hooks,
    selective_checkpoint_contexts,
)
from remat_dist._torch._dynamo import assume_constant_result
from remat_dist.core import _record
from remat_dist.core._compile_runtime import (
    RuntimeContext,
    RuntimeStates,
    mutated_at_runtime,
)
from remat_dist.core._state import fallback_replay_var, frame_var, name_prefix_var

if TYPE_CHECKING:
    from remat_dist.core._options import CheckpointOptions
    from remat_dist.core._types import RecomputeStateHook

__all__ = [
    "ANNOTATION",
    "compiling",
    "fallback_active",
    "fallback_name",
    "fallback_region_call",
    "name_scope",
    "nested_in_save",
    "recompute_needs_tensor",
    "refuse",
    "region_call",
    "run_checkpoint",
]

ANNOTATION = "remat_dist"
"""Key in ``node.meta["custom"]``: ``"recompute"`` or ``"save"``."""
_CHECKPOINT = "remat_dist_checkpoint"
"""Key in ``node.meta["custom"]``: the checkpoint's ``region_name``."""
_REGION = "remat_dist_region"
"""Key in ``node.meta["custom"]``: the region's qualified name."""
_PREFIX = "remat_dist_prefix"
"""Key in ``node.meta["custom"]``: the ``name_scope`` prefix (``a/b/``)."""

_fallback: ContextVar[tuple[str, str, str | None] | None] = ContextVar(
    "remat_dist_compile_fallback", default=None
)
"""``(checkpoint name, innermost mode, region name)`` while a compiled checkpoint's
body runs eagerly (Dynamo fell back after a graph break in it), else None."""


compiling: Callable[[], bool] = torch.compiler.is_compiling
"""True while Dynamo traces (the entry points take this module's path). torch's
own function, not a wrapper: every checkpoint call asks it."""


@assume_constant_result
def _enclosing() -> tuple[str | None, str | None, str | None, str]:
    """``(checkpoint name, innermost mode, region name, name prefix)`` of the code
    Dynamo is tracing now, read from the active ``fx.traceback.annotate`` s.

    Evaluated for real at trace time and folded into the graph as a constant (no
    guard): Dynamo enters every ``annotate`` it traces, so ``current_meta`` holds
    exactly the annotations around the traced code.
    """
    custom = fx_traceback.current_meta.get("custom") or {}
    return (
        custom.get(_CHECKPOINT),
        custom.get(ANNOTATION),
        custom.get(_REGION),
        custom.get(_PREFIX, ""),
    )


@assume_constant_result
def _eager_checkpoint() -> str:
    """The eager checkpoint whose forward or replay calls the code Dynamo traces
    now (``""`` if none), read at trace time and folded in as a constant."""
    record = frame_var.get()
    return "" if record is None else record.name


def _refuse_inside_eager(what: str) -> None:
    """Refuse compiled remat code called inside an eager checkpoint: the compiled
    graph is one autograd node to the eager record, which would neither see its
    save regions nor skip them on replay."""
    outer = _eager_checkpoint()
    if outer:
        refuse(
            f"remat_dist: {what} is compiled (torch.compile) but called inside the "
            f"eager checkpoint {outer!r}: the eager checkpoint sees the compiled code "
            "as one operation and would recompute it whole, save regions included. "
            "Fix: compile the checkpointed block itself (its checkpoint then "
            "compiles), or keep the inner code eager (torch.compiler.disable)."
        )


@assume_constant_result
def refuse(message: str) -> None:
    """Raise :class:`RematUsageError` at trace time, under ``fullgraph=True`` or not.

    A plain ``raise`` in traced code is a graph break, after which the frame would
    silently run eagerly without ``fullgraph``; called as a constant function, the
    error leaves Dynamo at once, as a ``torch._dynamo.exc.InternalTorchDynamoError``
    whose message starts with ``RematUsageError: <message>`` and whose
    ``__context__`` is this error.
    """
    raise RematUsageError(message)


# -- the selective-checkpoint policy ------------------------------------------------


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Per ATen op of a compiled checkpoint: save it (save region, collective) or
    recompute it (everything else)."""
    if getattr(op, "namespace", None) in ("_c10d_functional", "c10d"):
        return CheckpointPolicy.MUST_SAVE
    if _tracing():
        custom = fx_traceback.current_meta.get("custom") or {}
        mode = custom.get(ANNOTATION)
    else:  # torch's checkpoint runs for real: a graph break, or backend="eager"
        fallback = _fallback.get()
        if fallback is not None:
            mode = fallback[1]
        else:  # the graph, interpreted with each node's metadata
            custom = fx_traceback.current_meta.get("custom") or {}
            mode = custom.get(ANNOTATION)
            if mode is None:
                raise RematUsageError(
                    f"remat_dist: a compiled checkpoint ran {op} with no region "
                    "annotation: this backend runs the checkpoint's graph without "
                    "the node metadata the policy reads, so save regions would "
                    'silently be recomputed. Fix: compile with backend="aot_eager" '
                    'or "inductor".'
                )
        if mode == "save" and mutated_at_runtime(op):
            return CheckpointPolicy.MUST_RECOMPUTE
    if mode == "save":
        return CheckpointPolicy.MUST_SAVE
    if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()) and _has_opaque_inputs():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


def _tracing() -> bool:
    """Whether the policy is called while a graph is traced (Dynamo, AOTAutograd),
    not while a checkpoint runs."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return compiling() or get_proxy_mode() is not None


def _has_opaque_inputs() -> bool:
    """Whether the graph being traced takes an opaque object (a DTensor's
    ``DeviceMesh``).

    torch 2.13's ``functionalize_rng_ops`` puts the generator states it stashes for
    recomputed random ops among the forward's saved values counting symbolic ints
    only; with an opaque object saved as well, a ``DeviceMesh`` lands among the
    tensors and the forward fails (``expected all tensors_saved_with_vc_check to
    be Tensors``). There, random ops are kept instead of replayed.
    """
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    if mode is None:
        return False
    graph = mode.tracer.graph
    cached = _OPAQUE_GRAPHS.get(id(graph))
    if cached is not None and cached[0] is graph:
        return cached[1]
    found = any(
        not isinstance(n.meta.get("val"), (torch.Tensor, torch.SymInt, int, float, bool))
        and n.meta.get("val") is not None
        for n in graph.find_nodes(op="placeholder")
    )
    _OPAQUE_GRAPHS.clear()  # one graph is traced at a time
    _OPAQUE_GRAPHS[id(graph)] = (graph, found)
    return found


_OPAQUE_GRAPHS: dict[int, tuple[Any, bool]] = {}


def _sac_contexts() -> tuple[Any, Any]:
    """The checkpoint's ``context_fn`` (a module-level function, as Dynamo needs).

    Called by torch's checkpoint itself when it runs for real (a graph break in the
    body, ``backend="eager"``), the contexts also snapshot the generator states at
    the forward and restore them around the recompute (the eager checkpoint's
    default state hooks: ``backend="eager"`` runs torch's checkpoint with
    ``preserve_rng_state=False``), and mark the recompute for ``is_recomputing()``,
    since the body's Python runs again after a graph break.
    """
    forward, recompute = selective_checkpoint_contexts(_policy)
    if _tracing():
        return forward, recompute
    sac_bypasses_saved_tensor_hooks(forward)
    states = RuntimeStates(_record._SEAMS.hooks_provider())
    return RuntimeContext(forward, states, False), RuntimeContext(recompute, states, True)


# -- checkpoint -------------------------------------------------------------------


def run_checkpoint(
    fn: Callable[..., Any],
    name: str,
    hooks: tuple[RecomputeStateHook, ...] | None,
    options: CheckpointOptions,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """One call of a checkpointed function while Dynamo traces.

    ``hooks`` (``recompute_state_hooks``) are not called while the block compiles
    into one graph: its backward recomputes graph ops from saved tensors and stashed
    generator states, never Python, so no Python state can differ on its replay.
    After a graph break the body's Python does run again in backward, and there the
    hooks are snapshotted at its forward and restored around its recompute, as in
    eager remat (on top of the default RNG hooks, which always run there).
    """
    outer, _, _, _ = _enclosing()
    if outer is None:
        _refuse_inside_eager(f"checkpoint {name!r}")
    if outer is not None:
        refuse(
            f"remat_dist.checkpoint(region_name={name!r}) was entered inside checkpoint "
            f"{outer!r} (under torch.compile): nested checkpoints are not supported. "
            f"Fix: checkpoint the outer block only and mark the inner call with "
            f"remat_dist.region(fn, {name!r}, recompute=True), or checkpoint the "
            "inner blocks one by one instead of the outer one."
        )
    if options.saved_tensors_hooks is not None:
        refuse(
            f"remat_dist.checkpoint(region_name={name!r}): the option "
            "saved_tensors_hooks= cannot work under torch.compile: the compiled "
            "block keeps its tensors inside one compiled autograd node, which does "
            "not call per-checkpoint pack hooks. Fix: leave saved_tensors_hooks out "
            "of checkpoints you compile (wrap the call of the compiled module in "
            "torch.autograd.graph.saved_tensors_hooks instead), or keep the block "
            "eager."
        )
    if options.determinism_check != "metadata":
        refuse(
            f"remat_dist.checkpoint(region_name={name!r}): the option "
            f"determinism_check={options.determinism_check!r} cannot work under "
            "torch.compile: the compiled backward recomputes graph ops, and there is "
            "no Python replay whose tensors could be checked. Fix: "
            "determinism_check='metadata' (the default) for compiled blocks."
        )
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    call = functools.partial(fn, **kwargs) if kwargs else fn
    entry_states: list[Any] = []

    def body(*a: Any) -> Any:
        if not compiling():  # Dynamo fell back to the eager torch checkpoint
            return _fallback_body(call, name, a, hooks or (), entry_states)
        with fx_traceback.annotate({_CHECKPOINT: name, ANNOTATION: "recompute"}):
            return call(*a)

    if CHECKPOINT_EXITS_ON_ERROR:
        return torch_checkpoint.checkpoint(
            body, *args, use_reentrant=False, context_fn=_sac_contexts
        )
    try:
        return torch_checkpoint.checkpoint(
            body, *args, use_reentrant=False, context_fn=_sac_contexts
        )
    except BaseException as error:  # run for real after a graph break: exit it
        exit_left_checkpoints(error)
        raise


def _fallback_body(
    call: Callable[..., Any],
    name: str,
    args: tuple[Any, ...],
    hooks: tuple[RecomputeStateHook, ...],
    entry_states: list[Any],
) -> Any:
    """The body of a compiled checkpoint run eagerly by torch's checkpoint (its
    forward, then its recompute in backward), after a graph break in it. The user's
    state ``hooks`` are snapshotted into ``entry_states`` at the forward and
    restored around the recompute."""
    if hooks and fallback_replay_var.get():
        outside = [h.snapshot() for h in hooks]
        for h, state in zip(hooks, entry_states):
            h.restore(state)
        try:
            return _fallback_run(call, name, args)
        finally:
            for h, state in zip(hooks, outside):
                h.restore(state)
    if hooks:
        entry_states[:] = [h.snapshot() for h in hooks]
    return _fallback_run(call, name, args)


def _fallback_run(call: Callable[..., Any], name: str, args: tuple[Any, ...]) -> Any:
    outer = _fallback.get()
    record = frame_var.get()
    if outer is not None or record is not None:
        raise RematUsageError(
            f"remat_dist.checkpoint(region_name={name!r}) was entered inside checkpoint "
            f"{outer[0] if outer is not None else record.name!r}: nested checkpoints "
            "are not supported. Fix: checkpoint the outer block only and mark the "
            f"inner call with remat_dist.region(fn, {name!r}, recompute=True), or "
            "checkpoint the inner blocks one by one instead of the outer one."
        )
    token = _fallback.set((name, "recompute", None))
    try:
        return call(*args)
    finally:
        _fallback.reset(token)


def fallback_active() -> bool:
    """Whether a compiled checkpoint's body runs eagerly here (see module doc)."""
    return _fallback.get() is not None


def fallback_name() -> str | None:
    """The compiled checkpoint whose body runs eagerly here, if any."""
    state = _fallback.get()
    return None if state is None else state[0]


def fallback_region_call(
    fn: Callable[..., Any],
    name: str,
    recompute: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """A region call in a compiled checkpoint's body run eagerly: ``fn`` with the
    region's mode on the runtime stack, which :func:`_policy` reads."""
    checkpoint_name, mode, region_name = _fallback.get()  # type: ignore[misc]
    qual = f"{checkpoint_name}::{name_prefix_var.get()}{name}"
    if recompute and mode == "save":
        raise RematUsageError(nested_in_save(qual, region_name))
    token = _fallback.set((checkpoint_name, "recompute" if recompute else "save", qual))
    try:
        out = fn(*args, **kwargs)
    finally:
        _fallback.reset(token)
    if not _region_output_ok(out):
        raise RematUsageError(_bad_output(qual, out))
    return out


# -- regions ----------------------------------------------------------------------


def region_call(
    fn: Callable[..., Any],
    name: str,
    recompute: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """A ``region(fn, name, recompute=...)`` call while Dynamo traces: a plain call
    outside a checkpoint; inside one, ``fn`` under the region's annotation."""
    checkpoint_name, mode, region_name, prefix = _enclosing()
    if checkpoint_name is None:
        _refuse_inside_eager(f"region {name!r}")
        return fn(*args, **kwargs)
    qual = f"{checkpoint_name}::{prefix}{name}"
    if recompute and mode == "save":
        refuse(nested_in_save(qual, region_name))
    with fx_traceback.annotate(
        {_REGION: qual, ANNOTATION: "recompute" if recompute else "save"}
    ):
        out = fn(*args, **kwargs)
    if not _region_output_ok(out):
        refuse(_bad_output(qual, out))
    return out


def nested_in_save(qual: str, save_region: str | None) -> str:
    """The error for a recompute region inside a save region, eager or compiled
    (torch_remat's key phrase first)."""
    return (
        f"remat_dist: region {qual!r} was called with recompute=True while nested "
        f"inside a recompute=False (SAVE) region: region {qual!r} (recompute=True) "
        f"is nested inside save region {save_region!r}, whose body is never replayed. "
        "Fix: move the recompute region out of the save region, or make it "
        "recompute=False."
    )


def _bad_output(qual: str, out: Any) -> str:
    return (
        f"remat_dist: region {qual!r} returned a {type(out).__name__} (or a "
        "sequence holding something else than tensors and None); a region must "
        "return a tensor, or one tuple/list of tensors and None. Fix: return a "
        "tuple of tensors and build dicts or nested structures outside the region."
    )


def _region_output_ok(out: Any) -> bool:
    """What eager regions accept as an output (``_region._flatten_output``)."""
    if isinstance(out, torch.Tensor):
        return True
    return isinstance(out, (tuple, list)) and all(
        x is None or isinstance(x, torch.Tensor) for x in out
    )


def recompute_needs_tensor(tensors: tuple[Any, ...]) -> None:
    """``recompute_needs_tensor`` while Dynamo traces: only checks the arguments.

    The partitioner keeps every output of a save region (``MUST_SAVE``) that
    backward or a recompute reads, so nothing needs persisting by hand. Outside a
    checkpoint it is a no-op, as in eager.
    """
    if _enclosing()[0] is None:
        return
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            refuse(
                f"remat_dist.recompute_needs_tensor: expected tensors, got "
                f"{type(t).__name__}."
            )


@contextmanager
def name_scope(prefix: str) -> Any:
    """``name_scope`` while Dynamo traces: the prefix goes into the annotations."""
    _, _, _, outer = _enclosing()
    with fx_traceback.annotate({_PREFIX: f"{outer}{prefix}/"}):
        yield
