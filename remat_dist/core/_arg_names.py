"""Names of a checkpoint's inputs: the wrapped function's parameter names.

A report or an error calls the tensor a checkpoint received by the parameter it
was bound to (``hidden_states``, ``args[1]`` for a ``*args`` entry, the keyword
of a keyword argument), and ``input {i}`` only where the function has no
signature to bind to. A call notes nothing but the positional count and the
keywords; the signature is read when a name is asked for, once per function.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from remat_dist._torch._pytree import keystr, tree_flatten_with_path

__all__ = ["ArgumentNames", "argument_name", "leaf_names", "positional_name"]


class ArgumentNames(NamedTuple):
    """How a call's arguments map onto a function's parameters.

    Argument ``i`` of the call (its positional arguments, then its keyword
    arguments in order) is the function's positional argument ``i - first``, so
    ``first`` arguments of the call (a module handed to a generic runner) come
    before the function's own.
    """

    fn: Callable[..., Any] | None
    first: int
    nargs: int
    keywords: tuple[str, ...]


class _Layout(NamedTuple):
    positional: tuple[str, ...]
    varargs: str | None


_LAYOUTS: weakref.WeakKeyDictionary[Any, _Layout | None] = weakref.WeakKeyDictionary()
"""Parameter layout per callable (a bound method's under its function, so that a
module's ``forward`` is read once for all its instances)."""


def _read_layout(fn: Callable[..., Any]) -> _Layout | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or an extension type without one
        return None
    positional = []
    varargs = None
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            varargs = p.name
    return _Layout(tuple(positional), varargs)


def _layout(fn: Callable[..., Any]) -> _Layout | None:
    """The positional parameters ``fn`` binds a call's arguments to (a module's
    ``forward``'s; a bound method's without its ``self``)."""
    if isinstance(fn, torch.nn.Module):
        fn = fn.forward
    func = getattr(fn, "__func__", None) if inspect.ismethod(fn) else None
    key = fn if func is None else func
    try:
        layout = _LAYOUTS[key]
    except KeyError:
        layout = _LAYOUTS[key] = _read_layout(key)
    except TypeError:  # neither hashable nor weakly referable: read it each time
        return _read_layout(fn)
    if func is not None and layout is not None:
        if layout.positional:
            layout = _Layout(layout.positional[1:], layout.varargs)
        elif layout.varargs is None:
            return None
    return layout


def argument_name(names: ArgumentNames, index: int) -> str:
    """The name of argument ``index`` of the call ``names`` describes: its
    parameter's, ``args[j]`` for the ``j``-th entry of ``*args``, a keyword
    argument's keyword, else ``input {index}``."""
    if index >= names.nargs:
        return names.keywords[index - names.nargs]
    at = index - names.first
    layout = None if names.fn is None or at < 0 else _layout(names.fn)
    if layout is None:
        return f"input {index}"
    if at < len(layout.positional):
        return layout.positional[at]
    if layout.varargs is not None:
        return f"{layout.varargs}[{at - len(layout.positional)}]"
    return f"input {index}"


def positional_name(fn: Callable[..., Any] | None, index: int) -> str:
    """The name of positional argument ``index`` of a call of ``fn``: what reports
    call the inputs a plain ``torch.utils.checkpoint`` call keeps.

    Args:
        fn: the called function, or a module (its ``forward`` names the
            arguments); None where it is not known.
        index: the argument's position in the call.

    Returns:
        The parameter it binds to, ``args[j]`` for the ``j``-th entry of a
        ``*args``, else ``input {index}`` (no signature, or no such parameter).

    Example::

        >>> def block(hidden_states, *extra): ...
        >>> positional_name(block, 0), positional_name(block, 2)
        ('hidden_states', 'extra[1]')
    """
    return argument_name(ArgumentNames(fn, 0, index + 1, ()), index)


def leaf_names(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[str]:
    """A name per leaf of ``(args, kwargs)``, in ``tree_leaves`` order: the
    argument's name (see :func:`argument_name`), followed by the path into it for
    a leaf inside a container (``hidden[0]``, ``cache['k']``). For error messages
    only (it flattens the call again)."""
    names = ArgumentNames(fn, 0, len(args), tuple(kwargs))
    leaves, _ = tree_flatten_with_path((args, kwargs))
    out = []
    for path, _leaf in leaves:
        side, key, rest = path[0], path[1], path[2:]
        index = key.idx if side.idx == 0 else len(args) + list(kwargs).index(key.key)
        out.append(argument_name(names, index) + keystr(rest))
    return out
