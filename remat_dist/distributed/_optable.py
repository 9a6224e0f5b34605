"""What remat_dist knows of each ``c10d::`` collective op: which arguments it writes
and reads, which parameters verification compares, which metas are equal on every
rank of a correct SPMD program, whether serving it is safe; plus tensor metas and
process-group identities as the ledger records them."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = ["TensorMeta", "describe_signature"]


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
        return _new_meta(TensorMeta, (tuple(t.shape), t.dtype, t.device))

    def __str__(self) -> str:
        dt = _DTYPE_SHORT.get(self.dtype) or str(self.dtype).replace("torch.", "")
        where = "" if self.device.type == "cpu" else f"@{self.device}"
        return f"{dt}[{', '.join(map(str, self.shape))}]{where}"


_new_meta = tuple.__new__
"""``TensorMeta``'s construction without the namedtuple's Python ``__new__``
(every recorded or verified collective makes one per tensor)."""


def metas_of(
    idx: tuple[int, ...], args: tuple[Any, ...], defaults: tuple[Any, ...]
) -> tuple[TensorMeta, ...]:
    """The metas of the tensors at ``idx`` of an op's ``args`` (a tensor or a list
    of them, or of lists), in order."""
    tensors: list[torch.Tensor] = []
    n = len(args)
    for i in idx:
        _flatten(args[i] if i < n else defaults[i], tensors)
    return tuple(map(TensorMeta.of, tensors))


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
    same_io: bool = False
    """The op reads and writes the same tensors (its metas are compared once)."""
    tensor_idx: tuple[int, ...] = ()
    """Every argument whose type holds tensors."""


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
        same_io=row_out == row_in,
        tensor_idx=tuple(
            i for i, a in enumerate(schema.arguments) if "Tensor" in str(a.type)
        ),
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



def describe_signature(
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

