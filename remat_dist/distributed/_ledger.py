"""The ledger: the ordered collectives one checkpoint's forward issued."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from remat_dist._torch import _c10d
from remat_dist.distributed._intercept import CollectiveCall, _bypass
from remat_dist.distributed._optable import (
    TensorMeta,
    _materialize,
    _OpSpec,
    _template,
    describe_signature,
)

__all__ = ["CollectiveEntry", "CollectiveLedger"]


@dataclass(eq=False)
class CollectiveEntry:
    """One recorded collective: position, op, group, metas, parameters, kept outputs.

    ``kept`` holds clones of the tensors the collective wrote (after it completed),
    when recorded with ``keep_outputs=True`` and the op is servable; else None.
    """

    position: int
    op: str
    group_name: str
    group_ranks: tuple[int, ...]
    group_desc: str
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    params: tuple[tuple[str, Any], ...]
    kept: tuple[torch.Tensor, ...] | None = None
    packs_before: int = -1
    """Tensors the checkpoint had saved for backward when this was issued (-1:
    unknown); torch's early stop ends a replay at the last one, so an entry with
    ``packs_before`` >= the forward's total is never replayed."""
    _spec: _OpSpec | None = field(default=None, repr=False)
    _template: tuple[Any, ...] = field(default=(), repr=False)

    @classmethod
    def of(
        cls,
        call: CollectiveCall,
        position: int,
        kept: tuple[torch.Tensor, ...] | None = None,
        packs_before: int = -1,
    ) -> CollectiveEntry:
        op, gname, granks, ins, outs, params = call.signature
        return cls(
            position=position,
            op=op,
            group_name=gname,
            group_ranks=granks,
            group_desc=call.group.desc,
            inputs=ins,
            outputs=outs,
            params=params,
            kept=kept,
            packs_before=packs_before,
            _spec=call._spec,
            _template=_args_template(call),
        )

    @property
    def signature(self) -> tuple[Any, ...]:
        return (
            self.op,
            self.group_name,
            self.group_ranks,
            self.inputs,
            self.outputs,
            self.params,
        )

    def describe(self) -> str:
        return describe_signature(*self.signature)

    def agreement_token(self) -> str | None:
        """The part of this entry every rank of the group has equal (None: p2p)."""
        spec = self._spec
        agree = spec.agree if spec is not None else ""
        if agree is None:
            return None
        parts = [self.op, f"{self.group_desc}/{len(self.group_ranks)}"]
        if "i" in agree:
            parts.append(",".join(map(str, self.inputs)))
        if "o" in agree:
            parts.append(",".join(map(str, self.outputs)))
        ap = spec.agree_params if spec is not None else frozenset()
        parts.extend(f"{k}={v}" for k, v in self.params if k in ap)
        return "|".join(parts)

    def _issue_dummy(self, timeout_s: float | None) -> Any:
        """Issue this entry again on zero buffers (to release peers); returns Work."""
        spec = self._spec
        if spec is None:
            return None
        args = [_materialize(a) for a in self._template]
        if timeout_s is not None and spec.timeout_idx is not None:
            while len(args) <= spec.timeout_idx:
                args.append(spec.defaults[len(args)])
            args[spec.timeout_idx] = max(1, int(timeout_s * 1000))
        with _bypass():
            res = spec.overload(*args)
        return _work_of(res, spec)


def _args_template(call: CollectiveCall) -> tuple[Any, ...]:
    """``call``'s arguments with the tensors (where its op spec says they are)
    replaced by their metas: what :meth:`CollectiveEntry._issue_dummy` issues
    again on zeros, without holding the tensors."""
    spec, args = call._spec, call.args
    out = list(args)
    for i in spec.tensor_idx:
        if i < len(out):
            out[i] = _template(out[i])
    return tuple(out)


class CollectiveLedger:
    """The ordered collectives of one extent (one checkpoint's forward)."""

    __slots__ = ("entries", "_fp")

    def __init__(self, entries: Sequence[CollectiveEntry] = ()) -> None:
        self.entries: list[CollectiveEntry] = list(entries)
        self._fp: tuple[int, str] | None = None

    def append(self, entry: CollectiveEntry) -> None:
        self.entries.append(entry)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[CollectiveEntry]:
        return iter(self.entries)

    def __getitem__(self, i: int) -> CollectiveEntry:
        return self.entries[i]

    def __bool__(self) -> bool:
        return bool(self.entries)

    def fingerprint(self) -> str:
        """Hash of the rank-invariant part of every entry (point-to-point left out).

        Equal on every rank of a group for a correct SPMD program: groups enter as
        (description, size), not name, so ranks in different TP groups of a mesh
        still agree. This is what the store agreement compares. Cached until the
        ledger grows.
        """
        cached = self._fp
        if cached is not None and cached[0] == len(self.entries):
            return cached[1]
        h = hashlib.sha1()
        n = 0
        for e in self.entries:
            tok = e.agreement_token()
            if tok is not None:
                h.update(tok.encode())
                h.update(b"\n")
                n += 1
        fp = f"{h.hexdigest()[:16]}:{n}"
        self._fp = (len(self.entries), fp)
        return fp

    def group_fingerprints(self) -> dict[str, str]:
        """Per process group (``name/size``): hash of the rank-invariant part of
        the entries on it. Ranks of one group compare these; other groups' entries
        never enter (point-to-point left out). The result is shared: read it only.

        A model's checkpoints record the same few ledgers every step, so each
        distinct ledger is hashed once (:data:`_FINGERPRINTS`)."""
        key = tuple((e.signature, e.group_desc) for e in self.entries)
        fps = _FINGERPRINTS.get(key)
        if fps is None:
            if len(_FINGERPRINTS) >= _FINGERPRINTS_KEPT:
                _FINGERPRINTS.clear()
            fps = _FINGERPRINTS[key] = self._group_fingerprints()
        return fps

    def _group_fingerprints(self) -> dict[str, str]:
        hashers: dict[str, Any] = {}
        counts: dict[str, int] = {}
        for e in self.entries:
            tok = e.agreement_token()
            if tok is None:
                continue
            key = f"{e.group_name}/{len(e.group_ranks)}"
            h = hashers.get(key)
            if h is None:
                h = hashers[key] = hashlib.sha1()
            h.update(tok.encode())
            h.update(b"\n")
            counts[key] = counts.get(key, 0) + 1
        return {k: f"{h.hexdigest()[:16]}:{counts[k]}" for k, h in hashers.items()}

    @property
    def kept_nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for e in self.entries
            if e.kept is not None
            for t in e.kept
        )

    def release_kept(self) -> None:
        """Drop every kept output (after the last replay)."""
        for e in self.entries:
            e.kept = None

    def describe(self) -> str:
        return "\n".join(f"#{e.position}: {e.describe()}" for e in self.entries)

    def __repr__(self) -> str:
        return f"CollectiveLedger({len(self.entries)} entries)"


_FINGERPRINTS: dict[tuple[Any, ...], dict[str, str]] = {}
"""Group fingerprints by ledger content (signatures and group descriptions: plain
values, no tensor or group object); cleared when it holds
:data:`_FINGERPRINTS_KEPT` ledgers, so it never grows with the steps."""
_FINGERPRINTS_KEPT = 1024


# -------------------------------------------------------------------- results


def _work_of(result: Any, spec: _OpSpec) -> Any:
    """The ``Work`` of a ``c10d::`` op's result (None for an op that returns none)."""
    import torch.distributed as dist

    if spec.n_returns == 2:
        w = result[1]
    elif spec.n_returns == 1:
        w = result
    else:
        return None
    return dist.Work.unbox(w) if isinstance(w, torch.ScriptObject) else w


def _completed_result(call: CollectiveCall, written: list[torch.Tensor]) -> Any:
    """What ``call``'s op returns, already completed, for outputs ``written``
    (a served collective)."""
    spec = call._spec
    if spec.n_returns == 0:
        return None
    fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    fut.set_result(written)
    work = _c10d.work_from_future(fut).boxed()
    if spec.n_returns == 1:
        return work
    return (call._arg(spec.out_idx[0]), work)
