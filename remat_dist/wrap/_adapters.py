"""Model adapters: what ``apply_remat`` does by itself for a kind of model it knows.

A model library can make its models unsafe to recompute as they are (a KV cache
that every call appends to) and lay its blocks out in its own way. An adapter
tells ``apply_remat`` both, so that ``apply_remat(model)`` works on such a model
without ``blocks=`` and without preparing it by hand:

* :meth:`ModelAdapter.blocks`: the blocks to checkpoint when ``blocks=`` is not
  given (its decoder layers);
* :meth:`ModelAdapter.regions`: the save-region candidates of a
  ``MemoryBudget`` whose ``regions`` is None (its attention and MLP);
* :meth:`ModelAdapter.prepare`: make the model safe to recompute (turn its cache
  off while gradients are enabled, refuse its own checkpointing), returning the
  call that undoes it (``remove_remat`` runs it);
* :meth:`ModelAdapter.side_passes`: the context a ``MemoryBudget``'s profiling
  side passes run in, so that what the library records of a forward (transformers'
  ``output_router_logits``, say) sees the real pass only.

The wrapping layer only holds the seam. The adapters live in
``remat_dist.integrations`` and are attached by the composition root
(``remat_dist/__init__.py``), which imports every layer; an adapter must not
import its library at module level (``import remat_dist`` works without it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from torch import nn

from remat_dist.wrap._blocks import BlockSelector

__all__ = ["ModelAdapter", "adapter_for", "register_model_adapter"]


@runtime_checkable
class ModelAdapter(Protocol):
    """What ``apply_remat`` asks of a model library it knows (see the module doc)."""

    name: str
    """The library, for messages (``"transformers"``)."""

    def claims(self, model: nn.Module) -> bool:
        """True for a model of this library (cheap; must not import the library
        when it is not imported yet: no model of it can exist then)."""
        ...

    def blocks(self, model: nn.Module) -> BlockSelector:
        """The blocks to checkpoint when ``apply_remat`` gets no ``blocks=``."""
        ...

    def regions(
        self, model: nn.Module, blocks: Sequence[tuple[str, nn.Module]]
    ) -> tuple[str, ...] | None:
        """Save-region candidates (paths relative to each block) for a
        ``MemoryBudget`` without ``regions``; None: the budget's default names."""
        ...

    def prepare(
        self, model: nn.Module, blocks: Sequence[tuple[str, nn.Module]]
    ) -> Callable[[], None] | None:
        """Make ``model`` safe to recompute before ``blocks`` are checkpointed (or
        raise ``RematUsageError`` before changing anything); returns the call that
        undoes it, or None."""
        ...

    def side_passes(self, model: nn.Module) -> AbstractContextManager[None]:
        """The context the profiling side passes of a ``MemoryBudget`` run in."""
        ...


_adapters: list[ModelAdapter] = []


def register_model_adapter(adapter: ModelAdapter) -> None:
    """Let ``apply_remat`` use ``adapter`` for the models it claims (once per
    adapter; the composition root registers the built-in ones)."""
    if not isinstance(adapter, ModelAdapter):
        raise TypeError(f"{adapter!r} is not a ModelAdapter")
    if adapter not in _adapters:
        _adapters.append(adapter)


def adapter_for(model: nn.Module) -> ModelAdapter | None:
    """The first registered adapter that claims ``model`` (None: a plain model)."""
    for adapter in _adapters:
        if adapter.claims(model):
            return adapter
    return None
