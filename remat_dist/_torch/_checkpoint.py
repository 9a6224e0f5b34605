"""``torch.utils.checkpoint``'s internals that remat_dist builds on, and torch's
``checkpoint_wrapper`` (to refuse nesting inside it)."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as _tc

__all__ = [
    "METADATA_MODE",
    "METADATA_MODE_PLAIN",
    "EXTRA_INPUT_SAVES",
    "CheckpointFrame",
    "Holder",
    "StopRecomputationError",
    "checkpoint_wrapper_types",
    "early_stop_enabled",
    "frame_of_pack_hook",
    "live_holders",
    "register_metadata_fn",
    "replay_target",
    "CHECKPOINT_EXITS_ON_ERROR",
    "exit_left_checkpoints",
    "frame_function",
    "frame_saved_inputs",
    "is_input_padding",
    "run_checkpoint",
    "selective_checkpoint_contexts",
    "sac_bypasses_saved_tensor_hooks",
]

StopRecomputationError: type[BaseException] = _tc._StopRecomputationError
"""What torch's checkpoint raises to stop a replay early (at the last saved tensor)."""

Holder: Any = _tc._Holder
"""The packed stand-in of a tensor torch's checkpoint recomputes."""

CheckpointFrame: Any = _tc._CheckpointFrame
"""What torch's non-reentrant checkpoint keeps per call (recompute fn, inputs)."""

EXTRA_INPUT_SAVES: int = 0 if hasattr(_tc._CheckpointFrame, "save_inputs") else 1
"""How many tensors torch's checkpoint saves besides its inputs when its forward
starts: 1 on torch 2.11 and 2.12, which save the inputs through an autograd
Function together with an empty tensor (saved-tensor hooks see its pack and, to
start the replay, its unpack: 0 bytes); 0 from torch 2.13 on, which saves the
inputs directly (``_CheckpointFrame.save_inputs``)."""


def is_input_padding(t: Any) -> bool:
    """Whether ``t``, packed while torch's checkpoint saves its inputs, is the empty
    tensor torch 2.11 and 2.12 save with them (an empty leaf that requires grad;
    never on newer torch). Not a user's tensor: user hooks need not see it."""
    return bool(EXTRA_INPUT_SAVES) and t.numel() == 0 and t.is_leaf and t.requires_grad


METADATA_MODE = "remat_dist"
"""The ``determinism_check`` mode remat_dist hands torch's checkpoint: torch's own
pack hook calls the function registered under it (:func:`register_metadata_fn`)
on every tensor it saves and keeps the results on its frame (``x_metadatas``),
where it would otherwise call a no-op; remat_dist checks the replay itself."""

METADATA_MODE_PLAIN = "remat_dist_plain"
"""The mode whose function notes less (for checkpoints that save only plain
tensors); see ``core/_standin.py``."""


def register_metadata_fn(fn: Callable[[Any], Any], mode: str = METADATA_MODE) -> None:
    """Make ``fn`` what torch's checkpoint calls, under ``no_grad``, on each tensor
    its forward saves when ``determinism_check=mode``."""
    _tc._allowed_determinism_checks_to_fns[mode] = fn


def frame_of_pack_hook(pack: Any) -> Any:
    """The checkpoint frame of torch's checkpoint pack hook ``pack`` (the innermost
    saved-tensor hook while a checkpoint's forward context runs), or None when
    ``pack`` is another hook. Its ``x_metadatas`` fill with what the registered
    metadata function returns; ``ignore_saved_mismatch = True`` leaves the check of
    the replay to remat_dist."""
    code = getattr(pack, "__code__", None)
    if code is None or code is not _CHECKPOINT_PACK_CODE:
        return None
    return pack.__closure__[_FRAME_CELL].cell_contents


def _checkpoint_pack_code() -> tuple[Any, int]:
    """The code of torch's checkpoint pack hook and the index of its ``frame`` cell,
    found by making one hook pair on a bare frame."""
    frame = _tc._CheckpointFrame(None, False, None, None)
    pack = getattr(_tc._checkpoint_hook(frame), "pack_hook", None)
    cells = [c.cell_contents for c in getattr(pack, "__closure__", None) or ()]
    found = [i for i, c in enumerate(cells) if c is frame]
    for piece, ok in (
        ("_CheckpointFrame.x_metadatas", isinstance(getattr(frame, "x_metadatas", None), list)),
        ("_CheckpointFrame.ignore_saved_mismatch", hasattr(frame, "ignore_saved_mismatch")),
        ("_checkpoint_hook's pack hook over its frame", bool(found)),
    ):
        if not ok:
            from remat_dist._torch import unsupported_torch_message

            raise ImportError(unsupported_torch_message(f"torch.utils.checkpoint.{piece}"))
    return pack.__code__, found[0]  # type: ignore[union-attr]


_CHECKPOINT_PACK_CODE, _FRAME_CELL = _checkpoint_pack_code()


def replay_target(pack: Any) -> tuple[Any, Any] | None:
    """``(frame, gid)`` of torch's recomputation pack hook ``pack`` (the innermost
    saved-tensor hook while a replay's recompute context runs): the checkpoint frame
    being replayed and the graph task it is replayed for. After the replay, the
    frame's ``recomp_counter[gid]`` is how many tensors it saved and
    ``recomputed[gid]`` holds them (behind ``weak_holders[i]().handles[gid]``).
    None when ``pack`` is another hook or the frame is gone."""
    inner = getattr(pack, "__wrapped__", pack)  # torch._dynamo.disable's wrapper
    if getattr(inner, "__code__", None) is not _RECOMPUTE_PACK_CODE:
        return None
    cells = inner.__closure__
    frame = cells[_RECOMPUTE_CELLS[0]].cell_contents()
    if frame is None:
        return None
    return frame, cells[_RECOMPUTE_CELLS[1]].cell_contents


def _recompute_pack_code() -> tuple[Any, tuple[int, int]]:
    """The code of torch's recomputation pack hook and the indices of its frame
    reference and graph-task id cells, found by making one hook on a bare frame."""
    frame = _tc._CheckpointFrame(None, False, None, None)
    ref, gid = weakref.ref(frame), object()
    pack = getattr(_tc._recomputation_hook(ref, gid), "pack_hook", None)
    inner = getattr(pack, "__wrapped__", pack)
    cells = [c.cell_contents for c in getattr(inner, "__closure__", None) or ()]
    found = [
        [i for i, c in enumerate(cells) if c is want] for want in (ref, gid)
    ]
    missing = [
        piece
        for piece, ok in (
            ("_recomputation_hook's pack hook over its frame", bool(found[0])),
            ("_recomputation_hook's pack hook over its graph task", bool(found[1])),
            ("_CheckpointFrame.recomp_counter", hasattr(frame, "recomp_counter")),
            ("_CheckpointFrame.recomputed", hasattr(frame, "recomputed")),
            ("_CheckpointFrame.weak_holders", hasattr(frame, "weak_holders")),
        )
        if not ok
    ]
    if missing:
        from remat_dist._torch import unsupported_torch_message

        raise ImportError(
            unsupported_torch_message(f"torch.utils.checkpoint.{missing[0]}")
        )
    return inner.__code__, (found[0][0], found[1][0])


_RECOMPUTE_PACK_CODE, _RECOMPUTE_CELLS = _recompute_pack_code()


def live_holders(frame: Any, skip: int = 0) -> list[Any]:
    """The holders of ``frame`` still alive, from its ``skip``-th save on: what
    torch's checkpoint packed for each tensor its forward saved (the object a saved
    tensor's ``data`` gives). A holder dies with the saved tensor that holds it:
    when a backward that does not keep its graph has run that saved tensor's node,
    or with the graph. Unpacking a live one in a graph task that has not replayed
    the frame yet replays it."""
    out = []
    for ref in frame.weak_holders[skip:]:
        holder = ref()
        if holder is not None:
            out.append(holder)
    return out


def early_stop_enabled() -> bool:
    """Whether torch's checkpoint stops a replay at its last saved tensor now
    (``torch.utils.checkpoint.set_checkpoint_early_stop``)."""
    return _tc._enable_checkpoint_early_stop is not False


def checkpoint_wrapper_types() -> tuple[type, ...]:
    """torch's ``CheckpointWrapper`` class (empty without ``torch.distributed``)."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointWrapper,
        )
    except Exception:  # pragma: no cover - no torch.distributed
        return ()
    return (CheckpointWrapper,)


def run_checkpoint(function: Callable[..., Any], *args: Any, **options: Any) -> Any:
    """torch's non-reentrant checkpoint of ``function(*args)`` (``options``: its
    keyword options, ``context_fn`` among them) whose forward context and
    saved-tensor hooks are exited when ``function`` raises, with its exception.

    torch 2.13 and newer do this themselves. torch 2.11 and 2.12 leave them
    entered until the exception's traceback dies (its hooks stay pushed, the
    context's ``__exit__`` runs later, at an arbitrary point): there the same
    steps run here, on torch's own generator."""
    if _CHECKPOINT_EXITS_ON_ERROR:
        return _tc.checkpoint(function, *args, use_reentrant=False, **options)
    return _checkpoint_exiting_on_error(function, *args, **options)


@torch.compiler.disable
def _checkpoint_exiting_on_error(
    function: Callable[..., Any],
    *args: Any,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], Any] = _tc.noop_context_fn,
    determinism_check: str = _tc._DEFAULT_DETERMINISM_MODE,
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """torch 2.11/2.12's non-reentrant ``checkpoint``, with 2.13's exit on error."""
    gen = _tc._checkpoint_without_reentrant_generator(
        function, preserve_rng_state, context_fn, determinism_check, debug,
        early_stop, *args, **kwargs,
    )
    next(gen)
    try:
        ret = function(*args, **kwargs)
    except BaseException as e:
        try:
            gen.throw(e)
        except StopIteration:
            raise RuntimeError(
                "the checkpoint's forward context suppressed an exception of its "
                "forward: a failed forward has no value to return"
            ) from e
        raise
    try:
        next(gen)
    except StopIteration:
        return ret
    raise RuntimeError("torch's checkpoint generator yielded more than twice")


def _checkpoint_exits_on_error() -> bool:
    """Whether torch's checkpoint exits its forward context when the forward raises
    (torch 2.13 and newer), found by checkpointing a function that raises."""
    exited: list[bool] = []

    class Probe(Exception):
        pass

    class Context(contextlib.AbstractContextManager):
        def __exit__(self, *exc: Any) -> None:
            exited.append(True)

    def fail(x: Any) -> Any:
        raise Probe

    try:
        _tc.checkpoint(
            fail,
            torch.zeros(1, requires_grad=True),
            use_reentrant=False,
            preserve_rng_state=False,
            context_fn=lambda: (Context(), contextlib.nullcontext()),
        )
    except Probe:
        found = bool(exited)
    if not found:
        gc.collect()  # the generator left behind exits its contexts as it dies
    return found


CHECKPOINT_EXITS_ON_ERROR = _checkpoint_exits_on_error()
"""Whether torch's checkpoint exits its contexts when its forward raises (torch
2.13 and newer); see :func:`run_checkpoint` and :func:`exit_left_checkpoints`."""
_CHECKPOINT_EXITS_ON_ERROR = CHECKPOINT_EXITS_ON_ERROR


def exit_left_checkpoints(error: BaseException) -> None:
    """Exit the contexts of each torch checkpoint that ``error``, raised through
    it, left entered (torch 2.11, 2.12; nothing to do on newer torch): where
    :func:`run_checkpoint` cannot stand in for torch's checkpoint (a traced call
    Dynamo must see as torch's own, resumed eagerly after a graph break)."""
    if CHECKPOINT_EXITS_ON_ERROR:
        return
    left = []
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code is _CHECKPOINT_CODE:
            gen = frame.f_locals.get("gen")
            if getattr(gen, "gi_frame", None) is not None:
                left.append(gen)
        tb = tb.tb_next
    for gen in reversed(left):  # innermost first
        try:
            gen.throw(error)
        except BaseException:  # noqa: S110 - the error goes on as it was
            pass


_CHECKPOINT_CODE = getattr(
    getattr(_tc.checkpoint, "__wrapped__", _tc.checkpoint), "__code__", None
)


def selective_checkpoint_contexts(policy: Callable[..., Any]) -> tuple[Any, Any]:
    """torch's ``create_selective_checkpoint_contexts(policy)``, whose recompute
    reuses what the forward saved, op by op, without asking ``policy`` again.

    torch 2.13 and newer do this themselves. torch 2.11 and 2.12 ask the policy
    again during the recompute (``ctx.is_recompute``) and take a saved output for
    each op it answers "save" to: there the recompute is answered here with the
    forward's answers, per op in the forward's order, so a policy that can only
    decide while its forward runs (it reads the graph's node metadata) works."""
    if not _SAC_ASKS_ON_RECOMPUTE:
        return _tc.create_selective_checkpoint_contexts(policy)
    answers: defaultdict[Any, deque[Any]] = defaultdict(deque)

    def forward_answers(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if ctx.is_recompute:
            given = answers[op]
            return given.popleft() if given else _tc.CheckpointPolicy.MUST_RECOMPUTE
        answer = policy(ctx, op, *args, **kwargs)
        answers[op].append(answer)
        return answer

    return _tc.create_selective_checkpoint_contexts(forward_answers)


def sac_bypasses_saved_tensor_hooks(forward_context: Any) -> None:
    """Keep the tensors torch's selective checkpoint caches (``forward_context``:
    its forward mode) out of the saved-tensor hooks around it, as every supported
    torch does by default. torch 2.14 and newer ask for the choice
    (``respect_saved_tensors_hooks``, set by torch's checkpoint only on a mode it
    is handed directly) and warn while it is left to a default a later release
    flips."""
    if hasattr(forward_context, "respect_saved_tensors_hooks"):
        forward_context.respect_saved_tensors_hooks = False


def _sac_asks_on_recompute() -> bool:
    """Whether torch's selective checkpoint calls its policy during the recompute
    (torch 2.11, 2.12), found by one tiny checkpointed forward and backward."""
    asked: list[bool] = []

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(bool(getattr(ctx, "is_recompute", False)))
        return _tc.CheckpointPolicy.MUST_RECOMPUTE

    x = torch.ones(1, requires_grad=True)
    with torch.enable_grad():
        out = _tc.checkpoint(
            lambda t: t.sin().sin(),
            x,
            use_reentrant=False,
            preserve_rng_state=False,
            context_fn=lambda: _tc.create_selective_checkpoint_contexts(policy),
        )
        out.backward()
    return any(asked)


_SAC_ASKS_ON_RECOMPUTE = _sac_asks_on_recompute()


def frame_function(frame: Any) -> Any:
    """The function torch's checkpoint ``frame`` recomputes (the one given to
    ``torch.utils.checkpoint.checkpoint``): the ``fn`` cell of the closure of
    ``frame.recompute_fn`` (torch 2.11 through 2.15); None where it has none."""
    recompute = getattr(frame, "recompute_fn", None)
    code = getattr(recompute, "__code__", None)
    if code is None:
        return None
    cell = dict(zip(code.co_freevars, recompute.__closure__ or ())).get("fn")
    try:
        return None if cell is None else cell.cell_contents
    except ValueError:  # an empty cell
        return None


def frame_saved_inputs(frame: Any) -> list[tuple[int, Any]]:
    """``(argument index, SavedTensor)`` for each tensor input torch's checkpoint
    frame keeps for its replay (``SavedTensor.data``: what the pack hooks made of
    it, read without unpacking).

    torch 2.13 and newer keep them on the frame (``saved_args``); torch 2.11 and
    2.12 save them on an autograd Function's node (``frame.input_saver``), after
    an empty tensor and the keyword arguments, which are left out here."""
    saved_args = getattr(frame, "saved_args", None)
    if saved_args is not None:
        return [(i, a) for i, a in enumerate(saved_args) if hasattr(a, "register_hooks")]
    node = getattr(getattr(frame, "input_saver", None), "grad_fn", None)
    get_args = getattr(node, "get_args", None)
    if get_args is None:
        return []
    try:
        raw = node._raw_saved_tensors
    except RuntimeError:  # freed by a backward
        return []
    cells = dict(zip(get_args.__code__.co_freevars, get_args.__closure__ or ()))
    tensor_indices = cells["tensor_indices"].cell_contents
    # the node's inputs: (empty tensor, kwargs, *args)
    return [(index - 2, raw[k]) for k, index in enumerate(tensor_indices) if index >= 2]
