"""Which modules are "blocks": the selector shared by ``apply_remat`` and
``shard_model``.

A selector is one of

* a module class, or a tuple/list of classes (``isinstance`` match);
* a predicate ``(qualified_name, module) -> bool``;
* a fully qualified name (``"layers.0"``) or a list of them (each must exist);
* a list mixing classes and names.

The root module (qualified name ``""``) is never a block: checkpointing or sharding
the whole model as a "block" is what the root step of ``shard_model`` already does,
and a checkpoint around everything saves nothing.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Union

from torch import nn

from remat_dist._errors import RematUsageError

__all__ = ["BlockSelector", "select_blocks"]

BlockSelector = Union[
    type,
    str,
    Callable[[str, nn.Module], bool],
    Sequence[Union[type, str]],
]
"""What ``blocks=`` accepts (see the module docstring)."""


def _describe(blocks: object) -> str:
    if isinstance(blocks, type):
        return blocks.__name__
    text = repr(blocks)
    return text if len(text) < 80 else text[:77] + "..."


def select_blocks(
    model: nn.Module, blocks: BlockSelector, *, caller: str
) -> list[tuple[str, nn.Module]]:
    """``(qualified_name, module)`` of every block in ``model``, in
    ``named_modules()`` order (so block indices follow the model's layout).

    Raises :class:`RematUsageError` when the selector has a wrong type, names a
    module that does not exist, or matches nothing.
    """
    named = [(n, m) for n, m in model.named_modules() if n]
    classes: tuple[type, ...] = ()
    names: list[str] = []
    predicate: Callable[[str, nn.Module], bool] | None = None
    if isinstance(blocks, type):
        classes = (blocks,)
    elif isinstance(blocks, str):
        names = [blocks]
    elif callable(blocks):
        predicate = blocks
    elif isinstance(blocks, (list, tuple, set, frozenset)):
        for item in blocks:
            if isinstance(item, type):
                classes += (item,)
            elif isinstance(item, str):
                names.append(item)
            else:
                raise RematUsageError(
                    f"remat_dist.{caller}(blocks=...): items must be module classes or "
                    f"qualified names, got {type(item).__name__} {item!r}. Fix: pass "
                    "e.g. blocks=Block, blocks=['layers.0', 'layers.1'], or a "
                    "predicate (qualified_name, module) -> bool."
                )
    else:
        raise RematUsageError(
            f"remat_dist.{caller}(blocks=...): expected a module class, a list of "
            f"classes or qualified names, or a predicate, got {type(blocks).__name__}."
        )
    if names:
        known = {n for n, _ in named}
        for name in names:
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=3)
                hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
                raise RematUsageError(
                    f"remat_dist.{caller}(blocks=...): {type(model).__name__} has no "
                    f"submodule {name!r}.{hint} Names are those of "
                    "model.named_modules() (the root itself cannot be a block)."
                )
    wanted = set(names)
    out: list[tuple[str, nn.Module]] = []
    for name, module in named:
        hit = (
            name in wanted
            or (bool(classes) and isinstance(module, classes))
            or (predicate is not None and bool(predicate(name, module)))
        )
        if hit:
            out.append((name, module))
    if not out:
        raise RematUsageError(
            f"remat_dist.{caller}(blocks={_describe(blocks)}): no submodule of "
            f"{type(model).__name__} matches. Fix: pass the block class (e.g. the "
            "transformer block), its qualified names, or a predicate."
        )
    return out


def strictly_inside(outer: str, inner: str) -> bool:
    """True when qualified name ``inner`` names a proper descendant of ``outer``."""
    return inner != outer and (outer == "" or inner.startswith(outer + "."))
