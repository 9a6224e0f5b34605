"""Saved-tensor hooks that also see what a checkpoint keeps, and named saves.

``torch.autograd.graph.saved_tensors_hooks`` only sees what autograd packs while the
hook is innermost. Inside a checkpoint the innermost hook is the checkpoint's own, so
a plain torch hook never sees what a save region keeps or what replay must be fed.
:class:`saved_tensors_hooks` registers itself with remat_dist too, so the runtime can
route those tensors through it (offloading saved activations to CPU works through
it), and tells the pack hook why it is called (:func:`current_saved_tensor_info`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any

import torch

from remat_dist._errors import RematUsageError
from remat_dist._torch import _autograd
from remat_dist._torch._checkpoint import is_input_padding
from remat_dist.core._record import _SEAMS
from remat_dist.core._state import frame_var, hooks_var
from remat_dist.core._storage import storage_key
from remat_dist.core._types import SavedTensorInfo, SavedTensorKind

__all__ = [
    "current_saved_tensor_info",
    "save_for_backward",
    "saved_tensors_hooks",
]

_info_var: ContextVar[SavedTensorInfo | None] = ContextVar(
    "remat_dist_pack_info", default=None
)
inputs_of_var: ContextVar[str | None] = ContextVar(
    "remat_dist_packing_inputs_of", default=None
)
"""Set to a checkpoint's name while torch packs that checkpoint's inputs."""

_pending_names: ContextVar[
    dict[tuple[Any, ...], tuple[str, weakref.ref[torch.Tensor]]] | None
] = ContextVar("remat_dist_pending_names", default=None)


def _name_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (*storage_key(t), t.storage_offset(), t.shape)


def saved_name(t: torch.Tensor) -> str | None:
    """The ``save_for_backward`` name given to ``t`` by the Function now packing."""
    names = _pending_names.get()
    if not names:
        return None
    hit = names.get(_name_key(t))
    # The mapping outlives the Function's packing. Once the named tensor is gone,
    # its storage's address (part of the key) can come back as another tensor's:
    # that tensor must not inherit the name.
    if hit is None or hit[1]() is None:
        return None
    return hit[0]


def save_for_backward(ctx: Any, saved: Mapping[str, torch.Tensor | None]) -> None:
    """``ctx.save_for_backward`` with names, so that memory reports show them.

    Call it from a custom ``autograd.Function.forward``; ``ctx.saved_tensors`` gives
    the tensors back in the mapping's order.

    Args:
        ctx: the ``autograd.Function`` context.
        saved: ``{name: tensor}``; ``None`` values are saved as ``None``.

    Returns:
        None.

    Example::

        >>> remat_dist.save_for_backward(ctx, {"lse": lse, "probs": probs})
        >>> lse, probs = ctx.saved_tensors  # in backward
    """
    if not isinstance(saved, Mapping):
        raise RematUsageError(
            "remat_dist.save_for_backward(ctx, saved) takes a mapping of "
            f"name -> tensor, got {type(saved).__name__}. Fix: pass "
            "{'name': tensor, ...}."
        )
    if torch.compiler.is_compiling():
        # a compiled graph keeps its saves in one compiled node that no report
        # names: trace the save only (storage keys and context vars do not trace)
        ctx.save_for_backward(*saved.values())
        return
    names: dict[tuple[Any, ...], tuple[str, weakref.ref[torch.Tensor]]] = {}
    for name, t in saved.items():
        if not isinstance(name, str) or not name:
            raise RematUsageError(
                f"remat_dist.save_for_backward: names must be non-empty strings, got "
                f"{name!r}. Fix: use names such as 'lse' or 'probs'."
            )
        if t is not None:
            names[_name_key(t)] = (name, weakref.ref(t))
    # torch packs the tensors when the Function's forward returns, before the next
    # Function can call this again, so one pending mapping is all that is needed.
    _pending_names.set(names)
    ctx.save_for_backward(*saved.values())


def current_saved_tensor_info() -> SavedTensorInfo:
    """Inside a pack hook of :class:`saved_tensors_hooks`: why this tensor is packed.

    Returns:
        A :class:`SavedTensorInfo`: the kind, the checkpoint and region, and the
        value the hooks' ``capture_context`` returned where the tensor was made.

    Raises:
        RematUsageError: called outside a pack hook.

    Example::

        >>> def pack(t):
        ...     info = remat_dist.current_saved_tensor_info()
        ...     return t if info.kind is remat_dist.SavedTensorKind.BACKWARD else t.cpu()
    """
    info = _info_var.get()
    if info is None:
        raise RematUsageError(
            "remat_dist.current_saved_tensor_info() was called outside a pack hook. "
            "Fix: call it only from the pack function given to "
            "remat_dist.saved_tensors_hooks(pack, unpack)."
        )
    return info


class saved_tensors_hooks:  # noqa: N801 - mirrors torch's context manager name
    """Like ``torch.autograd.graph.saved_tensors_hooks``, and more.

    Outside a checkpoint the pair is installed as torch's hooks. It also sees what a
    checkpoint entered under it keeps: the checkpoint's inputs
    (``SavedTensorKind.CHECKPOINT_INPUT``), what its save regions save
    (``BACKWARD``) and the save-region outputs persisted for replay
    (``SAVE_OUTPUT``); call :func:`current_saved_tensor_info` inside ``pack`` to
    tell them apart. Entered inside a checkpoint (around a save region, say), it
    applies to what save regions keep there; everything else in the checkpoint is
    still recomputed rather than packed. A plain torch hook pair active when a
    checkpoint is entered (``torch.autograd.graph.save_on_cpu``, say) takes over the
    same role, as the innermost pair.

    Unpack timing, for offloaders that prefetch: when a checkpoint runs under these
    hooks its backward starts with the replay, so no unpack of what the checkpoint
    keeps comes before the replay starts. Code at the start of the checkpointed
    function under ``remat_dist.is_recomputing()`` runs before any of them. The
    persisted outputs of save regions are unpacked during the replay, where it
    skips each region, in region order; the saves of save regions are unpacked
    after the replay, as backward reaches their nodes. Each unpack goes to the pair
    that packed it, also after its ``with`` block has exited. (A second backward
    through a graph kept with ``retain_graph=True`` replays at its first unpack
    instead, as torch's checkpoint does: holding the replay's trigger past the
    first backward would keep the checkpoint's inputs alive as long as the loss.)

    Args:
        pack_hook: ``tensor -> packed``. Inside a save region it receives a detached
            tensor (same storage, version and Python attributes; a parameter stays
            an ``nn.Parameter``), so that an identity pack does not keep the graph
            alive.
        unpack_hook: ``packed -> tensor``.
        capture_context: optional ``() -> object``, called where the tensor is
            produced (at the save inside a save region, when the region returns for
            its outputs); :func:`current_saved_tensor_info` ``().context`` holds its
            value while ``pack`` runs. An output packed later, when a consumer
            persists it, still gets the value captured when it was produced (an
            offloader binds the chunk it belongs to). Checkpoint inputs and saves
            outside any checkpoint get None, as in torch_remat.

    Example::

        >>> def pack(t):
        ...     return t.to("cpu", non_blocking=True)
        >>> def unpack(t):
        ...     return t.to("cuda", non_blocking=True)
        >>> with remat_dist.saved_tensors_hooks(pack, unpack):
        ...     y = remat_dist.checkpoint(region_name="layers.0")(block)(x)
    """

    def __init__(
        self,
        pack_hook: Callable[[torch.Tensor], Any],
        unpack_hook: Callable[[Any], torch.Tensor],
        *,
        capture_context: Callable[[], Any] | None = None,
    ) -> None:
        if not callable(pack_hook) or not callable(unpack_hook):
            raise RematUsageError(
                "remat_dist.saved_tensors_hooks(pack_hook, unpack_hook): both must be "
                "callables."
            )
        if capture_context is not None and not callable(capture_context):
            raise RematUsageError(
                "remat_dist.saved_tensors_hooks(pack, unpack, capture_context=...): "
                f"capture_context must be a callable () -> object, got "
                f"{type(capture_context).__name__}."
            )
        self.pack = pack_hook
        self.unpack = unpack_hook
        self.capture_context = capture_context
        self._stack: list[tuple[Any, Any]] = []

    def capture(self) -> Any:
        """The context to pack a tensor produced here with (None without one)."""
        return self.capture_context() if self.capture_context is not None else None

    def pack_with(self, t: torch.Tensor, info: SavedTensorInfo) -> Any:
        """``pack(t)`` with ``info`` visible to :func:`current_saved_tensor_info`."""
        token = _info_var.set(info)
        try:
            return self.pack(t)
        finally:
            _info_var.reset(token)

    def unpack_with(self, packed: Any) -> torch.Tensor:
        if type(packed) is _Padding:
            return packed.tensor
        return self.unpack(packed)

    def _pack_outer(self, t: torch.Tensor) -> Any:
        ckpt = inputs_of_var.get()
        if ckpt is not None:
            if is_input_padding(t):  # torch 2.11/2.12's, not the user's
                return _Padding(t)
            info = SavedTensorInfo(SavedTensorKind.CHECKPOINT_INPUT, checkpoint=ckpt)
        else:
            info = SavedTensorInfo(SavedTensorKind.BACKWARD, name=saved_name(t))
        return self.pack_with(t, info)

    def __enter__(self) -> saved_tensors_hooks:
        token = hooks_var.set(hooks_var.get() + (self,))
        torch_hooks = extent = None
        if frame_var.get() is None:
            # Inside a checkpoint torch's checkpoint hook must stay innermost (what
            # is not in a save region is recomputed, not packed).
            torch_hooks = torch.autograd.graph.saved_tensors_hooks(
                self._pack_outer, self.unpack_with
            )
            torch_hooks.__enter__()
            opener = _SEAMS.hooks_extent
            if opener is not None:
                extent = opener()
        self._stack.append((token, torch_hooks, extent))
        return self

    def __exit__(self, *exc: Any) -> None:
        token, torch_hooks, extent = self._stack.pop()
        if extent is not None:
            extent.pop()
        if torch_hooks is not None:
            torch_hooks.__exit__(*exc)
        hooks_var.reset(token)


class _Padding:
    """The empty tensor torch 2.11 and 2.12's checkpoint saves with its inputs,
    kept as it is: user hooks see the same tensors on every torch release."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def for_user_hook(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached for a user pack hook: what the hook would see without remat.

    Detached, so that an identity pack does not close a reference cycle through the
    autograd node (a graph dropped without backward would leak); a parameter stays
    an ``nn.Parameter`` (offloaders leave FSDP's parameters alone by type) and a
    plain tensor keeps its Python attributes (markers hooks read).
    """
    detached = t.detach()
    if isinstance(t, torch.nn.Parameter):
        detached = torch.nn.Parameter(detached, requires_grad=False)
    if type(t) in (torch.Tensor, torch.nn.Parameter) and t.__dict__:
        detached.__dict__.update(t.__dict__)
    return detached


def innermost_hooks() -> saved_tensors_hooks | None:
    """The innermost :class:`saved_tensors_hooks` active in this context."""
    stack = hooks_var.get()
    return stack[-1] if stack else None


def entry_hooks(explicit: saved_tensors_hooks | None) -> saved_tensors_hooks | None:
    """The hooks a checkpoint entered here keeps its tensors under.

    ``explicit`` (the checkpoint's ``saved_tensors_hooks=``) wins; else the innermost
    torch hook pair: a :class:`saved_tensors_hooks`, or a plain torch pair nested
    inside one (or alone), which takes over as in torch_remat.
    """
    if explicit is not None:
        return explicit
    top = _autograd.top_saved_tensors_hooks(False)
    if top is None:
        return None
    pack, unpack = top
    owner = getattr(pack, "__self__", None)
    if isinstance(owner, saved_tensors_hooks) and pack == owner._pack_outer:
        return owner
    return saved_tensors_hooks(pack, unpack)


def as_hooks(value: Any, where: str) -> saved_tensors_hooks | None:
    """Normalise a ``saved_tensors_hooks=`` option: hooks object or (pack, unpack)."""
    if value is None or isinstance(value, saved_tensors_hooks):
        return value
    if isinstance(value, tuple) and len(value) == 2 and all(map(callable, value)):
        return saved_tensors_hooks(*value)
    raise RematUsageError(
        f"remat_dist.checkpoint(region_name={where!r}): saved_tensors_hooks must be a "
        "remat_dist.saved_tensors_hooks(pack, unpack) or a (pack, unpack) tuple, got "
        f"{type(value).__name__}."
    )
