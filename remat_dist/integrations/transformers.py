"""remat_dist on Hugging Face transformers models: ``apply_remat(model)`` just works.

A transformers ``PreTrainedModel`` needs two things that ``apply_remat`` cannot
guess from a plain model, and this adapter supplies both (the composition root,
``remat_dist/__init__.py``, registers :data:`ADAPTER` with ``remat_dist.wrap``, so
nothing needs importing by hand):

* **Recomputation must be safe.** With ``use_cache=True`` (the default of every
  decoder config) the model builds a KV cache in forward and each decoder layer
  appends its keys and values to it. A checkpointed layer recomputed in backward
  appends them a second time, and its attention then fails deep inside the model
  (``The size of tensor a (64) must match the size of tensor b (32)``), or, with
  another attention kernel or a profiling pass, later. transformers' own
  ``gradient_checkpointing_enable()`` turns the cache off for layers it
  checkpoints. :meth:`TransformersAdapter.prepare` does the same for the whole
  model: while gradients are enabled, every ``PreTrainedModel`` in it whose
  ``forward`` takes ``use_cache`` is called with ``use_cache=False`` (a forward
  pre-hook; a warning says so once when the config has the cache on).
  Generation under ``torch.no_grad()`` keeps the cache; ``remove_remat`` removes
  the hooks. transformers' own checkpointing on the same model is refused
  (two checkpoints would nest).
* **Where the blocks are.** Without ``blocks=``, the decoder layers are checkpointed:
  the outermost modules deriving from transformers' ``GradientCheckpointingLayer``
  (every decoder layer since transformers 4.5x), else the classes the model names
  in ``_no_split_modules``. A ``MemoryBudget`` without ``regions`` takes each
  layer's attention and MLP child (:func:`layout`).

Per architecture family (the submodule names ``{"<attention>": "save"}`` and a
``MemoryBudget`` use; :func:`layout` finds them, :func:`keep_attention` builds the
"attention kept" policy):

====================  ===========================  =============  ==========
family                examples                     attention      MLP
====================  ===========================  =============  ==========
dense                 Llama (kv heads = heads)     ``self_attn``  ``mlp``
grouped-query         Llama, Qwen2 (kv < heads)    ``self_attn``  ``mlp``
mixture-of-experts    Mixtral, Qwen2-MoE           ``self_attn``  ``mlp``
GPT-2 style           GPT2, GPT-BigCode            ``attn``       ``mlp``
sliding-window        Gemma2, Mistral              ``self_attn``  ``mlp``
====================  ===========================  =============  ==========

(A mixture of experts' ``mlp`` holds its router and experts.)

transformers is imported lazily: a model can only be a ``PreTrainedModel`` once
``transformers.modeling_utils`` is loaded, so :meth:`TransformersAdapter.claims`
looks it up in ``sys.modules`` and ``import remat_dist`` works without
transformers installed. docs/transformers.md is the five-minute guide.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat_dist._errors import RematUsageError
from remat_dist.wrap import BlockSelector

__all__ = [
    "ADAPTER",
    "TransformersAdapter",
    "TransformersLayout",
    "is_transformers_model",
    "keep_attention",
    "layout",
]

ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
"""Child names taken as a decoder layer's attention, in this order; then the first
child whose class name contains ``Attention``."""

MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward", "ffn", "moe")
"""Child names taken as a decoder layer's MLP (or mixture of experts), in this
order; then the first child whose class name says MLP, MoE, Experts or
FeedForward."""

_MLP_WORDS = ("mlp", "moe", "experts", "feedforward")
_GPT2_STYLE = frozenset({"gpt2", "gpt_bigcode", "gpt_neo", "gptj", "codegen"})
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def _pretrained_class() -> type | None:
    module = sys.modules.get("transformers.modeling_utils")
    return getattr(module, "PreTrainedModel", None) if module is not None else None


def is_transformers_model(model: Any) -> bool:
    """True for a transformers ``PreTrainedModel``; never imports transformers."""
    cls = _pretrained_class()
    return cls is not None and isinstance(model, cls)


# -- where the blocks and regions are ---------------------------------------------


@dataclass(frozen=True)
class TransformersLayout:
    """What remat_dist found in a transformers model (:func:`layout`).

    Attributes:
        model_type: the config's ``model_type`` (``"llama"``).
        family: ``"dense"``, ``"grouped-query"``, ``"mixture-of-experts"``,
            ``"GPT-2 style"`` or ``"sliding-window"`` (see the module doc).
        block_classes: the decoder-layer classes, for ``shard_model(blocks=...)`` or
            ``fully_shard``.
        blocks: qualified names of the decoder layers ``apply_remat`` checkpoints.
        attention: the attention child of every layer (None if not one name).
        mlp: the MLP / mixture-of-experts child of every layer (None likewise).
    """

    model_type: str
    family: str
    block_classes: tuple[type, ...]
    blocks: tuple[str, ...]
    attention: str | None
    mlp: str | None

    def regions(self) -> tuple[str, ...]:
        """The save-region candidates a ``MemoryBudget`` gets: attention, MLP."""
        return tuple(p for p in (self.attention, self.mlp) if p is not None)


def _decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - older transformers
        GradientCheckpointingLayer = ()  # noqa: N806
    found = [
        (n, m) for n, m in model.named_modules()
        if n and GradientCheckpointingLayer and isinstance(m, GradientCheckpointingLayer)
    ]
    if not found:
        names: set[str] = set()
        for m in model.modules():
            names.update(getattr(m, "_no_split_modules", None) or ())
        found = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in names]
    outer = [
        (n, m) for n, m in found
        if not any(n.startswith(o + ".") for o, _ in found if o != n)
    ]
    if not outer:
        raise RematUsageError(
            f"remat_dist.apply_remat: found no decoder layers in "
            f"{type(model).__name__} (no GradientCheckpointingLayer, no class named "
            "in _no_split_modules). Fix: pass blocks=<the layer class>."
        )
    return outer


def _child(block: nn.Module, names: Sequence[str], words: Sequence[str]) -> str | None:
    children = dict(block.named_children())
    for name in names:
        if name in children:
            return name
    for name, child in children.items():
        if any(w in type(child).__name__.lower() for w in words):
            return name
    return None


def _common(values: list[str | None]) -> str | None:
    return values[0] if values and all(v == values[0] for v in values) else None


def _family(config: Any, attention: str | None) -> str:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any((getattr(text, k, 0) or 0) > 1 for k in _EXPERT_KEYS):
        return "mixture-of-experts"
    if getattr(text, "model_type", "") in _GPT2_STYLE or attention == "attn":
        return "GPT-2 style"
    layer_types = getattr(text, "layer_types", None) or ()
    window = getattr(text, "sliding_window", None)
    if "sliding_attention" in layer_types or (
        window and getattr(text, "use_sliding_window", True) and not layer_types
    ):
        return "sliding-window"
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None)
    if heads and kv and kv < heads:
        return "grouped-query"
    return "dense"


def layout(model: nn.Module) -> TransformersLayout:
    """The decoder layers of a transformers ``model``, their attention and MLP
    children, and its architecture family. Raises :class:`RematUsageError` for a
    model that is not a transformers ``PreTrainedModel`` or has no decoder layer."""
    if not is_transformers_model(model):
        raise RematUsageError(
            f"remat_dist.integrations.transformers.layout: {type(model).__name__} is "
            "not a transformers PreTrainedModel. Fix: pass blocks= (and policy "
            "regions) to apply_remat yourself."
        )
    layers = _decoder_layers(model)
    classes = tuple(dict.fromkeys(type(m) for _, m in layers))
    attention = _common([_child(m, ATTENTION_NAMES, ("attention",)) for _, m in layers])
    mlp = _common([_child(m, MLP_NAMES, _MLP_WORDS) for _, m in layers])
    config = getattr(model, "config", None)
    return TransformersLayout(
        model_type=str(getattr(config, "model_type", "") or type(model).__name__),
        family=_family(config, attention),
        block_classes=classes,
        blocks=tuple(n for n, _ in layers),
        attention=attention,
        mlp=mlp,
    )


def keep_attention(model: nn.Module) -> dict[str, str]:
    """The "attention kept" policy for ``model``'s layers: ``{"self_attn": "save"}``
    (``{"attn": "save"}`` for GPT-2 style). The attention's activations are kept,
    the rest of each layer (norms, MLP) recomputed in backward."""
    found = layout(model)
    if found.attention is None:
        raise RematUsageError(
            f"remat_dist.integrations.transformers.keep_attention: the layers of "
            f"{type(model).__name__} have no one attention child. Fix: pass "
            "policy={'<attention submodule>': 'save'} to apply_remat yourself."
        )
    return {found.attention: "save"}


# -- making recomputation safe ----------------------------------------------------


def _use_cache_index(model: nn.Module) -> int | None:
    """Position of ``use_cache`` among ``forward``'s positional parameters (after
    self), or None when ``forward`` does not take it by name."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name == "use_cache":
            positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            return i if positional else -1
    return None


def _cache_off_hook(index: int, warn: Callable[[nn.Module], None]) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not torch.is_grad_enabled():
            return None  # no backward, no replay: generation keeps its cache
        if 0 <= index < len(args):
            if args[index]:
                warn(module)
            args = (*args[:index], False, *args[index + 1 :])
        else:
            if kwargs.get("use_cache"):
                warn(module)
            kwargs["use_cache"] = False
        return args, kwargs

    return hook


def prepare_for_recompute(model: nn.Module) -> Callable[[], None]:
    """Make a transformers ``model`` safe to recompute; returns the call that undoes
    it. ``apply_remat`` runs it (see the module doc).

    Refuses (:class:`RematUsageError`, before changing anything) a model with
    transformers' own gradient checkpointing on. Then every ``PreTrainedModel`` in
    ``model`` whose ``forward`` takes ``use_cache`` gets a forward pre-hook that
    passes ``use_cache=False`` while gradients are enabled, and one warning says so
    when a config has ``use_cache=True`` (or a call asks for it).
    """
    on = [n or "<model>" for n, m in model.named_modules()
          if m.__dict__.get("gradient_checkpointing") is True]
    if on:
        raise RematUsageError(
            f"remat_dist.apply_remat: {type(model).__name__} has transformers' own "
            f"gradient checkpointing on ({', '.join(on[:3])}"
            f"{', ...' if len(on) > 3 else ''}); with remat_dist's the checkpoints "
            "would nest. Fix: call model.gradient_checkpointing_disable() "
            "(activation_checkpointing_disable() since transformers 5) before "
            "apply_remat, or use only one of the two."
        )
    pretrained = _pretrained_class()
    targets = []
    for name, m in model.named_modules():
        if pretrained is not None and isinstance(m, pretrained):
            index = _use_cache_index(m)
            if index is not None:
                targets.append((name, m, index))
    warned: list[bool] = []

    def warn(module: nn.Module, *, why: str = "was called with use_cache=True") -> None:
        if warned:
            return
        warned.append(True)
        warnings.warn(
            f"remat_dist.apply_remat: {type(model).__name__} {why}: a "
            "checkpointed layer recomputed in backward would append its keys "
            "and values to the KV cache a second time. While gradients are "
            "enabled it now runs with use_cache=False, as transformers' own "
            "gradient checkpointing does (generation under torch.no_grad() keeps "
            "the cache). Set model.config.use_cache = False to silence this.",
            UserWarning,
            stacklevel=3,
        )

    if any(getattr(getattr(m, "config", None), "use_cache", False) for _, m, _ in targets):
        warn(model, why="has use_cache=True in its config")
    handles = [
        m.register_forward_pre_hook(_cache_off_hook(i, warn), with_kwargs=True)
        for _, m, i in targets
    ]

    def undo() -> None:
        for h in handles:
            h.remove()

    return undo


class TransformersAdapter:
    """The ``remat_dist.wrap`` model adapter for transformers models (see the
    module doc); :data:`ADAPTER` is the registered instance."""

    name = "transformers"

    def claims(self, model: nn.Module) -> bool:
        return is_transformers_model(model)

    def blocks(self, model: nn.Module) -> BlockSelector:
        return list(layout(model).blocks)

    def regions(
        self, model: nn.Module, blocks: Sequence[tuple[str, nn.Module]]
    ) -> tuple[str, ...] | None:
        attention = _common([_child(m, ATTENTION_NAMES, ("attention",)) for _, m in blocks])
        mlp = _common([_child(m, MLP_NAMES, _MLP_WORDS) for _, m in blocks])
        found = tuple(p for p in (attention, mlp) if p is not None)
        return found or None

    def prepare(
        self, model: nn.Module, blocks: Sequence[tuple[str, nn.Module]]
    ) -> Callable[[], None] | None:
        return prepare_for_recompute(model)

    @contextlib.contextmanager
    def side_passes(self, model: nn.Module) -> Iterator[None]:
        """No output recording during a ``MemoryBudget``'s side passes: the hooks
        behind ``output_router_logits`` / ``output_hidden_states`` /
        ``output_attentions`` append to the collector of the running forward
        (a context variable), and a side pass's router logits would otherwise join
        the real ones (and their load-balancing loss)."""
        module = sys.modules.get("transformers.utils.output_capturing")
        collector = getattr(module, "_active_collector", None)
        if collector is None:
            yield
            return
        token = collector.set(None)
        try:
            yield
        finally:
            collector.reset(token)


ADAPTER = TransformersAdapter()
"""Registered with ``remat_dist.wrap`` by ``remat_dist/__init__.py``."""
