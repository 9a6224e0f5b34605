"""An independent count of the bytes backward will need, for tests and benchmarks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from remat_dist.core import plain, saved_tensors_hooks

__all__ = ["SavedBytesCounter"]


class SavedBytesCounter:
    """An outermost :class:`remat_dist.saved_tensors_hooks` that sums unique storages.

    It sees what autograd packs outside checkpoints, checkpoint inputs (also those
    of ``torch.utils.checkpoint``), what save regions keep and the save-region
    outputs persisted for replay: every byte backward will need, counted once per
    storage, DTensors by their local shard. Storages of ``parameters`` (and of any
    ``nn.Parameter``) are summed apart, in :attr:`parameter_bytes`::

        with SavedBytesCounter(model.parameters()) as count:
            loss = model(batch)
        print(count.activation_bytes)
        loss.backward()

    Use it around forward only; the tensors are packed as they are (no copy).
    """

    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        self._params = {self._key(p) for p in parameters}
        self.activations: dict[Any, int] = {}
        self.parameters: dict[Any, int] = {}
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[Any, int]:
        local = plain(t)
        return (local.device, local.untyped_storage()._cdata)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = self._key(t)
        local = plain(t)
        is_param = key in self._params or isinstance(local, torch.nn.Parameter)
        bucket = self.parameters if is_param else self.activations
        bucket[key] = local.untyped_storage().nbytes()
        # detach: the same storage, without the output -> grad_fn reference cycle
        # that keeping an op's own output would make
        return t.detach()

    @property
    def activation_bytes(self) -> int:
        """Bytes of the unique non-parameter storages packed so far."""
        return sum(self.activations.values())

    @property
    def parameter_bytes(self) -> int:
        """Bytes of the unique parameter storages packed so far."""
        return sum(self.parameters.values())

    def __enter__(self) -> SavedBytesCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
