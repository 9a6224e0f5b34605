"""Observe, verify and serve every collective issued inside a dynamic extent.

This is the building block of remat_dist's collective ledger: a checkpoint records the
collectives its forward issues (:class:`RecordCollectives`), and its replay either
re-issues them while checking each one against the ledger *before* it is issued
(:class:`VerifyCollectives`) or issues none and hands back the outputs kept on forward
(:class:`ServeCollectives`, "comm-free replay"). An observer is active inside
``with observe_collectives(observer): ...`` on the calling thread only.

What is caught, and how
=======================

Every collective of torch 2.13 ends up as a call of a ``c10d::`` dispatcher op
(``c10d::allreduce_``, ``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``,
``c10d::allgather_into_tensor_coalesced_``, ``c10d::broadcast_``, ``c10d::send``, ...):

* ``torch.distributed`` functions call ``ProcessGroup.<op>()``, whose C++ body
  dispatches the matching ``c10d::`` op;
* functional collectives (``torch.ops._c10d_functional.*``, ``funcol.*``) have C++
  kernels that call ``ProcessGroup::<op>()`` too (``all_gather_into_tensor`` becomes
  ``allgather_into_tensor_coalesced_``, ``reduce_scatter_tensor`` becomes
  ``reduce_scatter_tensor_coalesced_``, ``all_to_all_single`` ``alltoall_base_``);
  ``wait_tensor`` is not a collective: it waits on the ``Work`` the collective
  returned, so it works unchanged when that ``Work`` was served;
* DTensor redistribution (TP plans, ``redistribute``, and the redistributions that
  DTensor's ``__torch_dispatch__`` does implicitly for an op) uses functional
  collectives;
* FSDP2 (``fully_shard``) calls ``dist.all_gather_single`` /
  ``dist.reduce_scatter_single`` (``_allgather_base_`` / ``_reduce_scatter_base_``)
  and ``dist.all_reduce`` for HSDP.

So one Python kernel per ``c10d::`` op, registered with ``torch.library`` at a
dispatch key that is *otherwise unused*, sees all four sources. The key is ``Fake``
(reserved in 2.13 for a C++ FakeTensor mode that has no kernels and no fallback yet).
At install, a *fallthrough* fallback is registered for it, so for every non-collective
op the dispatcher masks the key out while computing the kernel to call: including the
key costs an ordinary op nothing (measured: within noise). The key is added to the
thread-local *included* set only while an extent is active, so outside one the
kernels are never reached and nothing at all is paid. ``Fake`` sits *below*
``Python``: inside a ``__torch_dispatch__`` (DTensor's, a ``TorchDispatchMode``'s)
every key above ``Python`` is excluded (``TESTING_ONLY_GenericMode``, tried first,
missed DTensor's implicit redistributions for that reason), the keys below are not.
If a later torch gives ``Fake`` kernels or a fallback, the kernels are registered at
``BackendSelect`` instead (always reached, below ``Python`` too; they then check a
thread-local and pass through, a few microseconds per collective when no extent is
active). ``interception_key()`` says which is in use.

A ``TorchDispatchMode`` over the extent would cost every op a Python round trip;
wrapping ``torch.distributed`` functions misses functional collectives and FSDP2's
bound references; wrapping ``ProcessGroup`` methods misses the C++ callers.

Not caught: collectives issued on another thread (FSDP2 and DTensor issue theirs on
the calling thread; the autograd engine's CUDA worker threads see the key through
the thread-local state it propagates but not the observer stack, so they pass
through), calls made directly on a backend object (``pg._get_backend(dev).allreduce``,
bypassing the dispatcher), and torchcomms backends. ``c10d::check_for_nan`` is not a
collective and is left alone.

Serve mode: what it can and cannot do
=====================================

Record mode with ``keep_outputs=True`` waits for each collective inside the kernel
(``Work.wait()``: a host wait on gloo, a stream wait on NCCL, so async overlap is lost
on gloo only while recording) and clones its written tensors: the result of an
in-place op (``all_reduce``, ``broadcast``, ``reduce``), the output buffers of the
others. Serve mode verifies the call, copies the kept tensors into the caller's
buffers (through ``.data``, without a version-counter bump, as the real collective
would) and returns a completed ``Work`` built from a ``torch.futures.Future``
(``_create_work_from_future``, boxed); ``async_op=True``, ``Work.wait()``,
``get_future()``, functional collectives plus ``wait_tensor``, FSDP2's all-gather and
reduce-scatter and DTensor redistributions all work with it. Serving cannot:

* ``recv_any_source_``: the ``Work`` must report the source rank and a future-backed
  ``Work`` cannot; and since whether an entry is served must be decided alike on the
  two ends of a point-to-point transfer (a served ``send`` facing an issued
  ``recv_any_source_`` would hang), ``send`` / ``recv_`` are not served either: all
  point-to-point entries are re-issued (and verified);
* sparse all-reduce: the result is in ``Work.result()``, not in the buffers; also
  re-issued;
* a Python subclass of ``Work`` (to keep the async overlap while recording) is not
  used: once its Python object is collected the C++ side falls back to the base
  ``Work::wait``, which blocks forever (seen on 2.13) -- a hang risk we do not take.

Costs (torch 2.13 CPU, gloo, a shared 2-core box: treat as upper bounds)
=========================================================================

* outside an extent: nothing is reached; an ``all_reduce`` costs the same before
  and after install (with the ``BackendSelect`` fallback: +15 us per collective);
* ordinary ops inside an extent: no measurable change (``torch.add`` on 4 elements
  2.47 vs 2.48 us, a 64x64 matmul fwd+bwd 127 vs 131 us); a no-op
  ``TorchDispatchMode`` makes the same ``torch.add`` 10-35 us;
* entering and leaving an extent: 3-9 us;
* per collective inside an extent (a 1-float ``all_reduce``, 24 us bare in one
  process): +20-30 us for the Python kernel round trip alone, record +45-70 us,
  record with ``keep_outputs`` +75-100 us (wait + clone), verify +35-60 us;
  serving one costs 50-75 us in all and sends nothing (a real 2-rank one: 140-360).

Divergence: verification, release, agreement
============================================

Verify/serve compare each collective with the next ledger entry before issuing it
and raise :class:`~remat_dist.errors.CollectiveReplayError` naming the region label,
the rank, the position, the expected entry and the actual call. Given a
:class:`~remat_dist.distributed._ledger_agreement.ReplayAgreement`, the ranks also
agree through the c10d store (no collective) on the ledger before the replay issues
its first collective, and conclude through it at the end; a rank that diverges or
fails mid-replay first *releases* its peers by issuing the collectives they are
about to issue (the rest of the shared ledger, on zero buffers) so that nobody stays
blocked, then reports through the conclusion, so every rank raises within the
agreement's timeout. ``op_timeout`` additionally bounds each replayed collective
(gloo honours the ``timeout`` argument of the ``c10d::`` op).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple, Protocol

import torch

from remat_dist.errors import CollectiveReplayError

__all__ = [
    "CollectiveCall",
    "CollectiveEntry",
    "CollectiveLedger",
    "CollectiveObserver",
    "RecordCollectives",
    "ServeCollectives",
    "TensorMeta",
    "VerifyCollectives",
    "interception_key",
    "observe_collectives",
]


# --------------------------------------------------------------------------- metas


_DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


class TensorMeta(NamedTuple):
    """What a ledger compares of a tensor: shape, dtype and device."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(t.shape), t.dtype, t.device)

    def __str__(self) -> str:
        dt = _DTYPE_SHORT.get(self.dtype) or str(self.dtype).replace("torch.", "")
        where = "" if self.device.type == "cpu" else f"@{self.device}"
        return f"{dt}[{', '.join(map(str, self.shape))}]{where}"


def _flatten(x: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _flatten(y, out)
    return out


def _template(x: Any) -> Any:
    """``x`` with every tensor replaced by its TensorMeta (nesting kept)."""
    if isinstance(x, torch.Tensor):
        return TensorMeta.of(x)
    if isinstance(x, (list, tuple)):
        return [_template(y) for y in x]
    return x


def _materialize(x: Any) -> Any:
    """Inverse of :func:`_template`: zeros for every TensorMeta."""
    if isinstance(x, TensorMeta):
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    if isinstance(x, list):
        return [_materialize(y) for y in x]
    return x


# ------------------------------------------------------------------------ op specs

# op name -> (written args, read args, params, rank-invariant metas, agreed params,
#             servable). "Rank-invariant metas" says which metas every rank of the
#             group has equal for a correct program ("io": both, "i", "o", "": none);
#             None leaves the op out of the cross-rank fingerprint (point-to-point).
_TABLE: dict[
    str,
    tuple[
        tuple[str, ...], tuple[str, ...], tuple[str, ...], Any, tuple[str, ...], bool
    ],
] = {
    "allreduce_": (
        ("tensors",),
        ("tensors",),
        ("reduce_op",),
        "io",
        ("reduce_op",),
        True,
    ),
    "allreduce_coalesced_": (
        ("tensors",),
        ("tensors",),
        ("reduce_op",),
        "io",
        ("reduce_op",),
        True,
    ),
    "_allgather_base_": (("output_tensor",), ("input_tensor",), (), "io", (), True),
    "allgather_": (("output_tensors",), ("input_tensors",), (), "o", (), True),
    "allgather_coalesced_": (("output_lists",), ("input_list",), (), "o", (), True),
    "allgather_into_tensor_coalesced_": (("outputs",), ("inputs",), (), "io", (), True),
    "_reduce_scatter_base_": (
        ("output_tensor",),
        ("input_tensor",),
        ("reduce_op",),
        "io",
        ("reduce_op",),
        True,
    ),
    "reduce_scatter_": (
        ("output_tensors",),
        ("input_tensors",),
        ("reduce_op",),
        "i",
        ("reduce_op",),
        True,
    ),
    "reduce_scatter_tensor_coalesced_": (
        ("outputs",),
        ("inputs",),
        ("reduce_op",),
        "io",
        ("reduce_op",),
        True,
    ),
    "alltoall_": (("output_tensors",), ("input_tensors",), (), "", (), True),
    "alltoall_base_": (
        ("output",),
        ("input",),
        ("output_split_sizes", "input_split_sizes"),
        "",
        (),
        True,
    ),
    "broadcast_": (
        ("tensors",),
        ("tensors",),
        ("root_rank", "root_tensor"),
        "io",
        ("root_rank", "root_tensor"),
        True,
    ),
    "reduce_": (
        ("tensors",),
        ("tensors",),
        ("reduce_op", "root_rank", "root_tensor"),
        "io",
        ("reduce_op", "root_rank", "root_tensor"),
        True,
    ),
    "gather_": (
        ("output_tensors",),
        ("input_tensors",),
        ("root_rank",),
        "i",
        ("root_rank",),
        True,
    ),
    "scatter_": (
        ("output_tensors",),
        ("input_tensors",),
        ("root_rank",),
        "o",
        ("root_rank",),
        True,
    ),
    "barrier": ((), (), (), "", (), True),
    "monitored_barrier_": ((), (), (), "", (), True),
    # Point-to-point is never served: serving must be decided alike on both ends,
    # and a recv_any_source_ cannot be served (see the module docstring).
    "send": ((), ("tensors",), ("dst", "tag"), None, (), False),
    "recv_": (("tensors",), (), ("src", "tag"), None, (), False),
    "recv_any_source_": (("tensors",), (), ("tag",), None, (), False),
}
_NOT_COLLECTIVES = frozenset({"check_for_nan"})


@dataclass(frozen=True, eq=False)
class _OpSpec:
    name: str
    overload: Any  # torch._ops.OpOverload
    group_idx: int
    out_idx: tuple[int, ...]
    in_idx: tuple[int, ...]
    params: tuple[tuple[str, int], ...]
    agree: str | None
    agree_params: frozenset[str]
    servable: bool
    n_returns: int
    timeout_idx: int | None
    defaults: tuple[Any, ...]


def _spec_for(name: str, overload: Any) -> _OpSpec | None:
    schema = overload._schema
    names = [a.name for a in schema.arguments]
    if "process_group" not in names:
        return None
    row = _TABLE.get(name)
    if row is None:  # an op this version does not know: record it, never serve it
        tensor_args = tuple(
            i for i, a in enumerate(schema.arguments) if "Tensor" in str(a.type)
        )
        row_out: tuple[int, ...] = ()
        row_in = tensor_args
        params: tuple[tuple[str, int], ...] = ()
        agree, agree_params, servable = "", frozenset(), False
    else:
        outs, ins, pnames, agree, ap, servable = row
        row_out = tuple(names.index(n) for n in outs)
        row_in = tuple(names.index(n) for n in ins)
        params = tuple((n, names.index(n)) for n in pnames)
        agree_params = frozenset(ap)
    defaults = tuple(
        a.default_value if a.has_default_value() else None for a in schema.arguments
    )
    return _OpSpec(
        name=name,
        overload=overload,
        group_idx=names.index("process_group"),
        out_idx=row_out,
        in_idx=row_in,
        params=params,
        agree=agree,
        agree_params=agree_params,
        servable=servable,
        n_returns=len(schema.returns),
        timeout_idx=names.index("timeout") if "timeout" in names else None,
        defaults=defaults,
    )


# ---------------------------------------------------------------------- groups


class _GroupInfo(NamedTuple):
    name: str
    ranks: tuple[int, ...]
    desc: str

    def __str__(self) -> str:
        return f"group '{self.name}' (ranks {list(self.ranks)})"


_group_cache: weakref.WeakKeyDictionary[Any, _GroupInfo] = weakref.WeakKeyDictionary()


def _group_info(boxed_pg: Any) -> _GroupInfo:
    import torch.distributed as dist

    pg = dist.ProcessGroup.unbox(boxed_pg)
    info = _group_cache.get(pg)
    if info is None:
        try:
            ranks = tuple(dist.get_process_group_ranks(pg))
        except Exception:  # not registered with the Python world (a raw group)
            ranks = tuple(range(pg.size()))
        info = _GroupInfo(str(pg.group_name), ranks, str(getattr(pg, "group_desc", "")))
        _group_cache[pg] = info
    return info


_REDUCE_OP_NAMES: dict[int, str] = {}


def _param_value(name: str, value: Any) -> Any:
    if name == "reduce_op":
        code = int(value._get_method("op")())
        if not _REDUCE_OP_NAMES:
            import torch.distributed as dist

            for k, v in dist.ReduceOp.RedOpType.__members__.items():
                _REDUCE_OP_NAMES[int(v)] = k
        return _REDUCE_OP_NAMES.get(code, str(code))
    if isinstance(value, list):
        return tuple(value)
    return value


# --------------------------------------------------------------- calls and entries


class CollectiveCall:
    """One collective about to be issued, as an observer sees it.

    ``op`` is the ``c10d::`` op name (``allreduce_``, ``_allgather_base_``, ...);
    ``group``, ``inputs``, ``outputs`` and ``params`` are computed on first use.
    """

    __slots__ = ("_spec", "args", "_keyset", "_group", "_sig")

    def __init__(self, spec: _OpSpec, args: tuple[Any, ...], keyset: Any) -> None:
        self._spec = spec
        self.args = args
        self._keyset = keyset
        self._group: _GroupInfo | None = None
        self._sig: tuple[Any, ...] | None = None

    @property
    def op(self) -> str:
        return self._spec.name

    @property
    def group(self) -> _GroupInfo:
        if self._group is None:
            self._group = _group_info(self.args[self._spec.group_idx])
        return self._group

    def _arg(self, i: int) -> Any:
        args = self.args
        return args[i] if i < len(args) else self._spec.defaults[i]

    def output_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for i in self._spec.out_idx:
            _flatten(self._arg(i), out)
        return out

    def input_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for i in self._spec.in_idx:
            _flatten(self._arg(i), out)
        return out

    @property
    def signature(self) -> tuple[Any, ...]:
        """What verification compares: op, group, metas, parameters."""
        if self._sig is None:
            spec = self._spec
            ins = tuple(TensorMeta.of(t) for t in self.input_tensors())
            outs = (
                ins
                if spec.out_idx == spec.in_idx
                else tuple(TensorMeta.of(t) for t in self.output_tensors())
            )
            params = tuple((n, _param_value(n, self._arg(i))) for n, i in spec.params)
            g = self.group
            self._sig = (spec.name, g.name, g.ranks, ins, outs, params)
        return self._sig

    def set_timeout(self, seconds: float) -> bool:
        """Issue this call with a timeout of ``seconds`` (False: the op has none)."""
        i = self._spec.timeout_idx
        if i is None:
            return False
        args = list(self.args)
        while len(args) <= i:
            args.append(self._spec.defaults[len(args)])
        args[i] = max(1, int(seconds * 1000))
        self.args = tuple(args)
        return True

    def _servable(self) -> bool:
        return self._spec.servable and all(
            t.layout == torch.strided for t in self.input_tensors()
        )

    def to_entry(
        self, position: int, kept: tuple[torch.Tensor, ...] | None = None
    ) -> CollectiveEntry:
        op, gname, granks, ins, outs, params = self.signature
        return CollectiveEntry(
            position=position,
            op=op,
            group_name=gname,
            group_ranks=granks,
            group_desc=self.group.desc,
            inputs=ins,
            outputs=outs,
            params=params,
            kept=kept,
            _spec=self._spec,
            _template=tuple(_template(a) for a in self.args),
        )

    def describe(self) -> str:
        op, gname, granks, ins, outs, params = self.signature
        return _describe(op, gname, granks, ins, outs, params)

    def _issue(self) -> Any:
        return self._spec.overload._handle.redispatch_boxed(
            self._keyset & _AFTER, *self.args
        )


def _describe(
    op: str,
    gname: str,
    granks: tuple[int, ...],
    ins: tuple[TensorMeta, ...],
    outs: tuple[TensorMeta, ...],
    params: tuple[tuple[str, Any], ...],
) -> str:
    def metas(ms: tuple[TensorMeta, ...]) -> str:
        if len(ms) > 6:
            return f"[{', '.join(map(str, ms[:6]))}, ... ({len(ms)} tensors)]"
        return f"[{', '.join(map(str, ms))}]"

    text = f"{op} on group '{gname}' (ranks {list(granks)}) in={metas(ins)}"
    if outs is not ins:
        text += f" out={metas(outs)}"
    for k, v in params:
        text += f" {k}={v}"
    return text


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
    _spec: _OpSpec | None = field(default=None, repr=False)
    _template: tuple[Any, ...] = field(default=(), repr=False)

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
        return _describe(*self.signature)

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

    def local_fingerprint(self) -> str:
        """Hash of the full signatures (groups by name, p2p included)."""
        h = hashlib.sha1()
        for e in self.entries:
            h.update(e.describe().encode())
            h.update(b"\n")
        return h.hexdigest()[:16]

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


# --------------------------------------------------------------- installation

_install_lock = threading.Lock()
_installed = False
_KEY: Any = None  # torch._C.DispatchKey
_KEY_NAME = ""
_TLS_TOGGLED = True  # False: always reached (BackendSelect), check the stack
_AFTER: Any = None  # keyset of the keys below ours
_LIBS: list[Any] = []
_SPECS: dict[str, _OpSpec] = {}
_AVAILABLE: bool | None = None


def _dist_available() -> bool:
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            import torch.distributed as dist

            _AVAILABLE = bool(dist.is_available())
        except Exception:
            _AVAILABLE = False
    return _AVAILABLE


def _choose_key() -> tuple[str, bool]:
    try:
        fake = torch._C._parse_dispatch_key("Fake")
    except Exception:
        fake = None
    if (
        fake is not None
        and not torch._C._dispatch_has_backend_fallback(fake)
        and not torch._C._dispatch_get_registrations_for_dispatch_key("Fake")
    ):
        return "Fake", True
    return "BackendSelect", False


def _install() -> None:
    global _installed, _KEY, _KEY_NAME, _TLS_TOGGLED, _AFTER
    with _install_lock:
        if _installed:
            return
        import torch.distributed  # noqa: F401  (registers the c10d ops)
        from torch.library import Library, fallthrough_kernel

        name, toggled = _choose_key()
        key = torch._C._parse_dispatch_key(name)
        libs = []
        if toggled:
            fb = Library("_", "IMPL")
            fb.fallback(fallthrough_kernel, name)
            libs.append(fb)
        lib = Library("c10d", "IMPL")
        specs: dict[str, _OpSpec] = {}
        for qual in torch._C._dispatch_get_all_op_names():
            if not qual.startswith("c10d::"):
                continue
            op_name = qual.split("::", 1)[1]
            if op_name in _NOT_COLLECTIVES:
                continue
            packet = getattr(torch.ops.c10d, op_name)
            overload = packet.default
            spec = _spec_for(op_name, overload)
            if spec is None:
                continue
            specs[op_name] = spec
            lib.impl(op_name, _make_kernel(spec), name, with_keyset=True)
        libs.append(lib)
        _KEY, _KEY_NAME, _TLS_TOGGLED = key, name, toggled
        _AFTER = torch._C._dispatch_keyset_full_after(key)
        _SPECS.update(specs)
        _LIBS.extend(libs)
        _installed = True


def interception_key() -> str:
    """The dispatch key the collective kernels are registered at ("" before use)."""
    return _KEY_NAME


# ------------------------------------------------------------- per-thread state


class _TLS(threading.local):
    def __init__(self) -> None:
        self.stack: list[CollectiveObserver] = []
        self.bypass = 0


_tls = _TLS()


@contextlib.contextmanager
def _bypass() -> Iterator[None]:
    _tls.bypass += 1
    try:
        yield
    finally:
        _tls.bypass -= 1


def _make_kernel(spec: _OpSpec) -> Callable[..., Any]:
    redispatch = spec.overload._handle.redispatch_boxed

    def kernel(keyset: Any, *args: Any) -> Any:
        tls = _tls
        stack = tls.stack
        if not stack or tls.bypass:
            return redispatch(keyset & _AFTER, *args)
        call = CollectiveCall(spec, args, keyset)
        return _dispatch(stack, len(stack) - 1, call)

    kernel.__name__ = f"remat_dist_observe_{spec.name}"
    return kernel


def _dispatch(stack: list[CollectiveObserver], level: int, call: CollectiveCall) -> Any:
    if level < 0:
        return call._issue()
    observer = stack[level]
    return observer.on_collective(call, lambda: _dispatch(stack, level - 1, call))


class CollectiveObserver(Protocol):
    """What ``observe_collectives`` accepts.

    ``on_collective(call, issue)`` runs for every collective of the extent, on the
    thread that issues it, before anything is sent; it returns the op's result,
    normally ``issue()`` (which issues it, through any outer observer). An optional
    ``on_extent_error(exc)`` runs when an exception leaves the extent.
    """

    def on_collective(self, call: CollectiveCall, issue: Callable[[], Any]) -> Any: ...


@contextlib.contextmanager
def observe_collectives(observer: CollectiveObserver) -> Iterator[CollectiveObserver]:
    """Route every collective this thread issues inside the block through ``observer``.

    Nested extents chain: the innermost observer sees a call first and its
    ``issue()`` hands the call to the next one out. Without ``torch.distributed``
    (or before it is initialised) this only runs the block.
    """
    if not _dist_available():
        yield observer
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        yield observer
        return
    if not _installed:
        _install()
    stack = _tls.stack
    stack.append(observer)
    added = False
    if _TLS_TOGGLED and not torch._C._dispatch_tls_is_dispatch_key_included(_KEY):
        torch._C._dispatch_tls_set_dispatch_key_included(_KEY, True)
        added = True
    try:
        yield observer
    except BaseException as exc:
        handler = getattr(observer, "on_extent_error", None)
        if handler is not None:
            handler(exc)
        raise
    finally:
        if added:
            torch._C._dispatch_tls_set_dispatch_key_included(_KEY, False)
        if stack and stack[-1] is observer:
            stack.pop()
        else:  # popped out of order: remove this one only
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is observer:
                    del stack[i]
                    break


# -------------------------------------------------------------------- results


def _work_of(result: Any, spec: _OpSpec) -> Any:
    import torch.distributed as dist

    if spec.n_returns == 2:
        w = result[1]
    elif spec.n_returns == 1:
        w = result
    else:
        return None
    return dist.Work.unbox(w) if isinstance(w, torch.ScriptObject) else w


def _completed_result(call: CollectiveCall, written: list[torch.Tensor]) -> Any:
    from torch._C._distributed_c10d import _create_work_from_future

    spec = call._spec
    if spec.n_returns == 0:
        return None
    fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    fut.set_result(written)
    work = _create_work_from_future(fut).boxed()
    if spec.n_returns == 1:
        return work
    return (call._arg(spec.out_idx[0]), work)


# ------------------------------------------------------------------ observers


class RecordCollectives:
    """Record mode: append one :class:`CollectiveEntry` per collective to ``ledger``.

    ``keep_outputs=True`` also keeps what each servable collective wrote (waiting for
    it inside the kernel, then cloning), for :class:`ServeCollectives`.
    """

    def __init__(
        self, ledger: CollectiveLedger | None = None, *, keep_outputs: bool = False
    ) -> None:
        self.ledger = ledger if ledger is not None else CollectiveLedger()
        self.keep_outputs = keep_outputs

    def on_collective(self, call: CollectiveCall, issue: Callable[[], Any]) -> Any:
        _ = call.signature  # computed (and cached) before the op writes its buffers
        result = issue()
        kept = None
        if self.keep_outputs and call._servable():
            work = _work_of(result, call._spec)
            if work is not None:
                work.wait()
            kept = tuple(t.detach().clone() for t in call.output_tensors())
        self.ledger.append(call.to_entry(len(self.ledger), kept))
        return result

    def finish(self, *, complete: bool = True) -> None:
        """Nothing to check while recording (uniform with the replay modes)."""


def _rank_default() -> int | None:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else None
    except Exception:
        return None


_FIX = (
    "A replay must issue the collectives its forward issued, in the same order, "
    "groups, shapes and dtypes, on every rank: keep the checkpointed function's "
    "collectives independent of data that changes between forward and replay (and "
    "restore RNG state with recompute_state_hooks), or use collectives='save' so the "
    "replay issues none."
)


class VerifyCollectives:
    """Verify mode: check each collective against the next ledger entry, then issue it.

    Raises :class:`CollectiveReplayError` *before* issuing an extra collective or one
    with another op, group, shape, dtype or parameter, naming ``label``, ``rank``, the
    position, the expected entry and the actual call; :meth:`finish` raises when
    entries were not replayed.

    With ``agreement`` (a ``ReplayAgreement``), the ranks agree on the ledger's
    fingerprint through the store before the first collective is issued and conclude
    through it in :meth:`finish`; a rank that diverges or fails first issues the rest
    of the ledger on zero buffers (``release_peers``, default: on with an agreement),
    so peers blocked in those collectives are let go, and every rank raises at the
    conclusion. ``op_timeout`` (seconds) is passed to every issued collective whose
    op takes a timeout.
    """

    _serving = False

    def __init__(
        self,
        ledger: CollectiveLedger,
        *,
        label: str,
        rank: int | None = None,
        agreement: Any = None,
        release_peers: bool | None = None,
        op_timeout: float | None = None,
    ) -> None:
        self.ledger = ledger
        self.label = label
        self.rank = _rank_default() if rank is None else rank
        self.agreement = agreement
        self.release_peers = (
            (agreement is not None) if release_peers is None else release_peers
        )
        self.op_timeout = op_timeout
        self.position = 0
        self.issued = 0
        self.served = 0
        self._agreed = False
        self._concluded = False
        self._finished = False
        self._failed: BaseException | None = None

    # -- per collective
    def on_collective(self, call: CollectiveCall, issue: Callable[[], Any]) -> Any:
        if self._failed is not None:
            raise self._failed
        pos = self.position
        entries = self.ledger.entries
        expected = entries[pos] if pos < len(entries) else None
        if expected is None or expected.signature != call.signature:
            self._diverge(self._mismatch_message(pos, expected, call), pos)
        self.position = pos + 1
        assert expected is not None
        return self._perform(call, issue, expected)

    def _perform(
        self, call: CollectiveCall, issue: Callable[[], Any], expected: CollectiveEntry
    ) -> Any:
        if self.agreement is not None and not self._agreed:
            self._agree()
        if self.op_timeout is not None:
            call.set_timeout(self.op_timeout)
        self.issued += 1
        return issue()

    def _issues(self, entry: CollectiveEntry) -> bool:
        """Whether this mode issues ``entry`` (so peers wait for it)."""
        return True

    # -- messages
    def _where(self) -> str:
        rank = "" if self.rank is None else f"rank {self.rank}, "
        return f"{rank}checkpoint '{self.label}'"

    def _mismatch_message(
        self, pos: int, expected: CollectiveEntry | None, call: CollectiveCall
    ) -> str:
        if expected is None:
            exp = f"nothing (the forward issued {len(self.ledger)} collective(s))"
        else:
            exp = expected.describe()
        mode = "serving" if self._serving else "replay"
        return (
            f"{self._where()}: collective #{pos} of the {mode} differs from the "
            f"forward's ledger.\n  expected: {exp}\n  actual:   {call.describe()}\n"
            f"{_FIX}"
        )

    # -- agreement
    def _agree(self) -> None:
        self._agreed = True
        self.agreement.agree(self.label, self.ledger.fingerprint(), rank_hint=self.rank)

    def _will_issue_any(self) -> bool:
        return any(self._issues(e) for e in self.ledger.entries)

    def _conclude(self, status: str | None) -> None:
        self._concluded = True
        self.agreement.conclude(self.label, status)

    # -- failure paths
    def _release(self, start: int) -> None:
        timeout = self.op_timeout
        if timeout is None and self.agreement is not None:
            timeout = float(self.agreement.timeout)
        works = []
        for e in self.ledger.entries[start:]:
            if self._issues(e):
                try:
                    works.append(e._issue_dummy(timeout))
                except Exception:
                    break
        # Peers reach the conclusion only after these complete, so waiting is only
        # for tidiness; it is bounded (an op without a timeout argument could
        # otherwise block here up to the group's own timeout).
        bound = timedelta(seconds=timeout if timeout is not None else 60.0)
        for w in works:
            if w is not None:
                with contextlib.suppress(Exception):
                    w.wait(bound)

    def _diverge(self, message: str, pos: int) -> None:
        err = CollectiveReplayError(message)
        self._failed = err
        self._report(message, pos, err)
        raise err

    def _report(self, status: str, pos: int, err: BaseException | None) -> None:
        """Release peers and conclude; raises the conclusion's verdict if any."""
        if self.agreement is not None and not self._agreed:
            if not self._will_issue_any():
                return  # peers issue nothing, so they neither wait nor agree
            try:
                self._agree()
            except CollectiveReplayError as verdict:
                self._failed = verdict
                raise verdict from err
        if self.release_peers:
            self._release(pos)
        if self.agreement is not None and not self._concluded:
            try:
                self._conclude(status)
            except CollectiveReplayError as verdict:
                self._failed = verdict
                raise verdict from err

    def finish(self, *, complete: bool = True) -> None:
        """End of the replay: raise if entries are missing (``complete``), conclude.

        ``complete=False`` is for a replay that stops early on purpose (all ranks stop
        at the same point): the entries it did not reach are not an error.
        """
        if self._failed is not None:
            raise self._failed
        if self._finished:
            return
        self._finished = True
        if complete and self.position < len(self.ledger):
            missing = self.ledger.entries[self.position :]
            listed = "\n".join(f"  #{e.position}: {e.describe()}" for e in missing[:8])
            more = f"\n  ... and {len(missing) - 8} more" if len(missing) > 8 else ""
            self._diverge(
                f"{self._where()}: the replay ended after {self.position} of the "
                f"forward's {len(self.ledger)} collective(s); missing:\n{listed}{more}\n"
                f"{_FIX}",
                self.position,
            )
        if self._agreed and not self._concluded:
            self._conclude(None)

    def on_extent_error(self, exc: BaseException) -> None:
        if exc is self._failed or (
            isinstance(exc, CollectiveReplayError) and self._concluded
        ):
            return
        if type(exc).__name__ == "_StopRecomputationError":  # early stop: normal end
            self.finish(complete=False)
            return
        if (
            self._concluded
            or self._failed is not None
            or not isinstance(exc, Exception)
        ):
            return
        self._failed = exc
        status = (
            f"{self._where()}: the replay failed at collective #{self.position} "
            f"with {type(exc).__name__}: {exc}"
        )
        try:
            self._report(status, self.position, exc)
        except CollectiveReplayError as verdict:
            if _others_in(verdict, self.rank):
                raise verdict from exc
            # only this rank failed: its own exception is the clearer one


def _others_in(verdict: CollectiveReplayError, rank: int | None) -> bool:
    ranks = getattr(verdict, "failed_ranks", None)
    if ranks is None:
        return True
    return any(r != rank for r in ranks)


class ServeCollectives(VerifyCollectives):
    """Serve mode ("comm-free replay"): verify each collective, then, instead of
    issuing it, write the outputs kept on forward into its buffers and return a
    completed ``Work``. Entries recorded without kept outputs (not servable, or
    recorded with ``keep_outputs=False``) are issued, as in verify mode.
    """

    _serving = True

    def _issues(self, entry: CollectiveEntry) -> bool:
        return entry.kept is None

    def _perform(
        self, call: CollectiveCall, issue: Callable[[], Any], expected: CollectiveEntry
    ) -> Any:
        kept = expected.kept
        if kept is None:
            return super()._perform(call, issue, expected)
        written = call.output_tensors()
        with torch.no_grad():
            for dst, src in zip(written, kept, strict=True):
                dst.data.copy_(src)
        self.served += 1
        return _completed_result(call, written)
