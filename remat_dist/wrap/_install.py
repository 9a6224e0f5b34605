"""The one interface through which blocks get (and lose) their checkpoints.

``apply_remat`` builds a :class:`BlockInstaller` for the blocks it selected and
installs the first plan with it; a policy decided at run time (a
``MemoryBudget``, see :mod:`remat_dist.wrap._planned`) gets the same installer and
drives every later change through it: the profiling passes, the plan it installs,
its removal. Nothing else patches a block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from remat_dist.core import CheckpointRecord, RecomputeStateHook, checkpoint
from remat_dist.wrap._patch import (
    BLOCK_ATTR,
    REGION_ATTR,
    BlockRemat,
    call_block,
    install_block,
    install_region,
    instance_forward,
    patch_state,
    restore_patch_state,
    uninstall,
)

__all__ = ["BlockInstaller", "Regions"]

Regions = Mapping[str, str]
"""``{submodule path: "save" | "recompute"}`` of one block's checkpoint (``{}``:
full recompute)."""


@dataclass
class BlockInstaller:
    """Checkpoints ``blocks`` (``(qualified name, module)`` pairs) of one model with
    the checkpoint options ``apply_remat`` was given."""

    blocks: list[tuple[str, nn.Module]]
    state_hooks: tuple[RecomputeStateHook, ...] | None
    collectives: str
    determinism_check: str
    side_passes: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    """The context a planner's side passes run in (a model adapter's), if any."""
    _index: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._index = {name: i for i, (name, _) in enumerate(self.blocks)}

    def runner(self, name: str) -> Any:
        """A checkpoint of block ``name``'s forward as ``install`` builds them:
        ``runner(module, *args, **kwargs)``."""
        return checkpoint(
            region_name=name,
            recompute_state_hooks=self.state_hooks,
            collectives=self.collectives,
            determinism_check=self.determinism_check,
        )(call_block)

    def install(self, plans: Mapping[str, Regions | None]) -> None:
        """Give each named block the checkpoint its plan says (regions, or None for
        no checkpoint), replacing what it had. Every checkpoint is built first: a
        bad option fails before anything changes."""
        built = []
        for name, regions in plans.items():
            module = self.blocks[self._index[name]][1]
            run = None if regions is None else self.runner(name)
            built.append((name, module, regions, run))
        for name, module, regions, run in built:
            _uninstall_block(module)
            if regions is None:
                continue
            install_block(module, BlockRemat(
                name=name,
                regions=dict(regions),
                state_hooks=self.state_hooks,
                collectives=self.collectives,
                previous_forward=instance_forward(module),
                run=run,
            ))
            for path, mode in regions.items():
                install_region(module.get_submodule(path), path, mode, block=name)

    def wrap_runs(self, wrap: Callable[[int, Any], Any]) -> None:
        """Replace each checkpointed block's run by ``wrap(index, run)`` (until the
        next ``install``)."""
        for index, (_, module) in enumerate(self.blocks):
            spec = module.__dict__.get(BLOCK_ATTR)
            if spec is not None:
                spec.run = wrap(index, spec.run)

    @contextlib.contextmanager
    def regions_kept(self, index: int, paths: Sequence[str]) -> Iterator[None]:
        """Make ``paths`` of block ``index`` save regions for the duration (a
        planner's side pass), and put back exactly what they were after."""
        name, module = self.blocks[index]
        done = []
        try:
            for path in paths:
                sub = module.get_submodule(path)
                done.append((sub, patch_state(sub)))
                install_region(sub, path, "save", block=name)
            yield
        finally:
            for sub, state in reversed(done):  # patches stacked on one module too
                restore_patch_state(sub, state)

    def replays(self) -> int:
        """Replays run so far by the blocks' checkpoints."""
        return sum(
            spec.replays for _, m in self.blocks
            if (spec := m.__dict__.get(BLOCK_ATTR)) is not None
        )

    def live_records(self) -> list[CheckpointRecord]:
        """The blocks' checkpoint records whose graph is alive."""
        return [
            r for _, m in self.blocks
            if (spec := m.__dict__.get(BLOCK_ATTR)) is not None
            for r in spec.pending
        ]


def _uninstall_block(module: nn.Module) -> None:
    """Take a block's checkpoint and its regions off (what ``install`` put on)."""
    for _, sub in module.named_modules():
        if REGION_ATTR in sub.__dict__ or BLOCK_ATTR in sub.__dict__:
            uninstall(sub)
