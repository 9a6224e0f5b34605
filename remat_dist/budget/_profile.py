"""The memory-budget planner's measurements: saved bytes and recompute time of each
candidate of a block, taken in the profiling step (see ``remat_dist.budget._planner``).

* :class:`Counter` counts saved bytes as ``remat_dist.testing.SavedBytesCounter``
  does (unique storages, parameters apart); around the model's forward it chains to
  the caller's saved-tensor hooks, around a side pass it keeps what it sees.
* :func:`profile_block` runs the side passes of one block on copies of its inputs,
  with the RNG states and the block's buffers put back after them, and returns
  ``{decision: (bytes, seconds)}``.
* :func:`candidates` lists a block's decisions; :func:`parse_bytes` reads
  ``"1.5GiB"``.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from remat_dist._errors import RematUsageError
from remat_dist._torch._autograd import top_saved_tensors_hooks
from remat_dist._torch._module import buffers_of
from remat_dist._torch._pytree import tree_leaves, tree_map
from remat_dist.core import current_saved_tensor_info, plain, saved_tensors_hooks
from remat_dist.distributed import (
    CPURNGStateHook,
    bare_hooks_extent,
    default_state_hooks,
)
from remat_dist.wrap import BlockInstaller, call_block

__all__ = [
    "DEFAULT_REGION_NAMES",
    "MAX_BYTES",
    "MAX_REGIONS",
    "MIN_CUT_FRACTIONS",
    "Candidate",
    "CompiledPricing",
    "Counter",
    "candidates",
    "compile_options",
    "human",
    "min_cut_candidates",
    "param_keys",
    "parse_bytes",
    "profile_block",
]

DEFAULT_REGION_NAMES = ("attention", "attn", "self_attn", "mlp", "feed_forward", "ffn")
"""Direct submodules of a block taken as save regions when ``regions`` is None."""

MAX_REGIONS = 4
"""Most save regions per block (candidates grow as ``2**regions``)."""

MAX_BYTES = 2**63 - 1
"""Largest byte count :func:`parse_bytes` accepts (an int64)."""

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"1.5GiB"``, ``"512 MiB"``, ``"1e6"``, ``"4096"`` or an int -> bytes (int).

    Binary (``KiB``, ``MiB``, ``GiB``, ``TiB``) and decimal (``KB``, ``MB``, ...)
    suffixes, case-insensitive; the arithmetic is exact (``"1.1KB"`` is 1100).
    Raises ``ValueError`` naming the text for anything else, for a count that is
    not a whole number of bytes (``"0.5"``) and for one above ``MAX_BYTES``.
    """
    if isinstance(text, bool):
        raise ValueError(f"a byte count must be an int or a string, got {text!r}")
    if isinstance(text, int):
        value = Fraction(text)
    else:
        m = re.fullmatch(
            r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text)
        )
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"cannot read {text!r} as a byte count: use an int or a number with a "
                "suffix KiB, MiB, GiB, TiB (or KB, MB, GB, TB), e.g. '1.5GiB'."
            )
        number = m.group(1)
        exponent = re.search(r"[eE]([+-]?[0-9]+)$", number)
        if exponent is not None and abs(int(exponent.group(1))) > 30:
            raise ValueError(f"{text!r} is out of range for a byte count.")
        value = Fraction(number) * _UNITS[unit]
    if value.denominator != 1:
        raise ValueError(
            f"{text!r} is {float(value):g} bytes, not a whole number of bytes. Fix: "
            f"give whole bytes, e.g. {math.ceil(value)}."
        )
    if value > MAX_BYTES:
        raise ValueError(
            f"{text!r} is more than {MAX_BYTES:,} bytes, out of range for a byte count."
        )
    return int(value)


def human(n: int) -> str:
    """``n`` bytes for people: ``"1.50 GiB"``, ``"512 B"``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


class Counter:
    """Counts saved bytes as ``SavedBytesCounter`` does (unique storages, parameters
    apart). ``chain=True``: then hands each tensor to the saved-tensor hooks that
    were innermost when it was entered (the caller's offloading or counting keeps
    working during the step it measures); otherwise it keeps the tensor itself."""

    def __init__(self, params: set[Any], *, chain: bool) -> None:
        self._params = params
        self.activations: dict[Any, int] = {}
        self._outer: Any = None
        if chain:
            top = top_saved_tensors_hooks(False)
            if top is not None:
                pack, unpack = top
                owner = getattr(pack, "__self__", None)
                self._outer = owner if isinstance(owner, saved_tensors_hooks) else (pack, unpack)
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        local = plain(t)
        key = (local.device, local.untyped_storage()._cdata)
        if key not in self._params and not isinstance(local, nn.Parameter):
            self.activations[key] = local.untyped_storage().nbytes()
        outer = self._outer
        if outer is None:
            # the version too: autograd skips its own check for hooked tensors
            return t.detach(), t._version
        if isinstance(outer, saved_tensors_hooks):
            return outer.pack_with(t, current_saved_tensor_info())
        return outer[0](t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        outer = self._outer
        if outer is None:
            t, version = packed
            if t._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been "
                    f"modified by an inplace operation: [{t.type()} {list(t.shape)}] "
                    f"is at version {t._version}; expected version {version} instead "
                    "(seen by remat_dist.MemoryBudget's saved-bytes counter)."
                )
            return t
        if isinstance(outer, saved_tensors_hooks):
            return outer.unpack_with(packed)
        return outer[1](packed)

    @property
    def total(self) -> int:
        return sum(self.activations.values())

    def __enter__(self) -> Counter:
        # the step it counts issues FSDP2's and TP's collectives under these
        # hooks: remat_dist.saved_tensors_hooks issue them without the hooks
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def param_keys(model: nn.Module) -> set[Any]:
    """The parameter storages ``SavedBytesCounter(model.parameters())`` would set
    apart if built before the forward. Inside an FSDP2 forward the unsharded
    parameters are plain tensors standing in for the sharded DTensors: a counter
    built outside the forward does not know their storages (it counts saved views
    of them as activations), so neither does this one."""
    fsdp = _fsdp_module_type()
    sharded = fsdp is not None and any(isinstance(m, fsdp) for m in model.modules())
    keys = set()
    for p in model.parameters():
        if sharded and not _is_dtensor(p):
            continue
        local = plain(p)
        keys.add((local.device, local.untyped_storage()._cdata))
    return keys


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


@dataclass(frozen=True)
class Candidate:
    label: str
    regions: tuple[str, ...] | None  # None: no checkpoint; (): full recompute
    memory_budget: float | None = None
    """Compiled only: no checkpoint, the block compiled with AOTAutograd's
    min-cut partitioner at this ``activation_memory_budget`` (it chooses the
    ops to recompute within the block)."""


MIN_CUT_FRACTIONS = (0.1, 0.2, 0.3, 0.5, 0.75)
"""The ``activation_memory_budget`` levels a compiled block is priced at
(candidates ``"min-cut 0.1"`` ...), with inductor. Dense at the low end, where
one level's bytes differ most from the next: with levels 0.25 and up only, a
tight budget left a tenth of itself unused and fell back to full recompute of
whole blocks (``benchmarks/budget_compile.py``)."""


def min_cut_candidates(options: tuple[tuple[str, Any], ...]) -> list[Candidate]:
    """The per-block min-cut candidates for ``MemoryBudget(compile=options)``:
    with inductor (the default backend) and neither ``mode`` nor ``options``
    (a backend given as a callable takes neither); none otherwise (other
    backends do not partition by a memory budget)."""
    given = dict(options)
    if given.get("backend", "inductor") != "inductor" or "mode" in given or "options" in given:
        return []
    return [Candidate(f"min-cut {f:g}", None, f) for f in MIN_CUT_FRACTIONS]


def compile_options(options: tuple[tuple[str, Any], ...], memory_budget: float | None) -> dict[str, Any]:
    """``torch.compile`` options for a block: the budget's, and for a min-cut
    candidate inductor under that ``activation_memory_budget``."""
    out = dict(options)
    if memory_budget is not None:
        out["backend"] = _min_cut_backend(memory_budget)
    return out


_BACKENDS: dict[float, Any] = {}


def _min_cut_backend(fraction: float) -> Any:
    """Inductor compiling under ``activation_memory_budget=fraction``; one
    object per fraction (blocks at one fraction share Dynamo's graphs, blocks
    at another do not)."""
    backend = _BACKENDS.get(fraction)
    if backend is None:
        from remat_dist._torch import _dynamo

        inductor = _dynamo.lookup_backend("inductor")

        def backend(gm: Any, example_inputs: Any) -> Any:
            with _dynamo.functorch_config_patch(activation_memory_budget=fraction):
                return inductor(gm, example_inputs)

        backend.__name__ = f"inductor_min_cut_{fraction:g}"
        _BACKENDS[fraction] = backend
    return backend


def candidates(name: str, block: nn.Module, regions: Sequence[str] | None) -> list[Candidate]:
    if regions is None:
        children = dict(block.named_children())
        paths = [n for n in DEFAULT_REGION_NAMES if n in children]
    else:
        paths = list(regions)
        for path in paths:
            try:
                block.get_submodule(path)
            except AttributeError:
                subs = [n for n, _ in block.named_modules() if n][:12]
                raise RematUsageError(
                    f"remat_dist.MemoryBudget(regions=...): block {name!r} "
                    f"({type(block).__name__}) has no submodule {path!r}. Its "
                    f"submodules: {', '.join(subs)}. Fix: name paths relative to the "
                    "block, or regions=() for full recompute or nothing."
                ) from None
        for a in paths:
            for b in paths:
                if a != b and b.startswith(a + "."):
                    raise RematUsageError(
                        f"remat_dist.MemoryBudget(regions=...): in block {name!r}, "
                        f"{b!r} lies inside {a!r}; a save region covers its "
                        "submodules. Fix: list one of them."
                    )
    if len(paths) > MAX_REGIONS:
        raise RematUsageError(
            f"remat_dist.MemoryBudget: block {name!r} has {len(paths)} save regions "
            f"{paths}; at most {MAX_REGIONS} (candidates grow as 2**regions). Fix: "
            "pass regions=... with the largest submodules."
        )
    out = [Candidate("full", ())]
    for k in range(1, len(paths) + 1):
        for subset in itertools.combinations(paths, k):
            out.append(Candidate("save " + "+".join(subset), tuple(subset)))
    out.append(Candidate("none", None))
    return out


def _rng_hooks(state_hooks: Sequence[Any] | None) -> list[Any]:
    hooks = list(default_state_hooks(cpu=True))
    hooks.append(CPURNGStateHook())
    hooks.extend(state_hooks or ())
    return hooks


def profile_block(
    installer: BlockInstaller,
    index: int,
    cands: list[Candidate],
    args: tuple,
    kwargs: dict,
    *,
    params: set[Any],
    repeats: int,
    compiled: CompiledPricing | None = None,
) -> dict[str, tuple[int, float]]:
    """``{decision: (saved bytes, recompute seconds)}`` of each candidate of block
    ``index`` of ``installer``, from side passes (their graphs dropped at once) on
    fresh copies of its tensor inputs, so that in-place updates of an input stay in
    the copy. When it returns, the RNG states and the block's buffers (its
    submodules' included: BatchNorm statistics, token counters) are as they were
    before.

    With ``compiled`` (the blocks will run compiled), the bytes are those the
    compiled block saves: each candidate also runs compiled once per block
    signature (:class:`CompiledPricing`), and its difference to the eager bytes
    is added. The eager bytes of full recompute stay in ``compiled.eager_full``
    (what the model's eager profiling forward saved for the block)."""
    name, module = installer.blocks[index]
    hooks = _rng_hooks(installer.state_hooks)
    snaps = [h.snapshot() for h in hooks]
    buffers = _snapshot_buffers(module)
    inputs = (args, kwargs)

    def restore(fresh: bool = True) -> Any:
        """Put the RNG states and the buffers back; fresh copies of the inputs."""
        for h, s in zip(hooks, snaps):
            h.restore(s)
        _restore_buffers(buffers)
        return tree_map(functools.partial(_copy_input, params=params), inputs) if fresh else None

    row: dict[str, tuple[int, float]] = {}
    try:
        run = installer.runner(f"{name}[budget profile]")
        for cand in cands:
            if cand.memory_budget is not None:
                continue  # compiled only: priced below, from "none"
            a, kw = restore()
            with Counter(params, chain=False) as count:
                if cand.regions is None:
                    out = call_block(module, *a, **kw)
                else:
                    with installer.regions_kept(index, cand.regions):
                        out = run(module, *a, **kw)
            del out, a, kw
            row[cand.label] = (count.total, 0.0)
        for cand in cands:
            if cand.memory_budget is not None:
                row[cand.label] = row["none"]
        if compiled is not None:
            compiled.eager_full[index] = compiled.eager_full.get(index, 0) + row["full"][0]
            deltas, times = compiled.measure(
                installer, index, cands, args, kwargs, row, restore, params, repeats)
            row = {label: (w + deltas[label], times[label]) for label, (w, t) in row.items()}
            return row
        paths = sorted({p for c in cands for p in (c.regions or ())})
        block_s, region_s = _time_block(module, paths, restore, repeats)
    finally:
        restore(fresh=False)
    for cand in cands:
        if cand.regions is None:
            t = 0.0
        else:
            t = max(0.0, block_s - sum(region_s[p] for p in cand.regions))
        row[cand.label] = (row[cand.label][0], t)
    return row


class CompiledPricing:
    """What a block saves and recomputes when compiled, for a budget with
    ``compile=``.

    AOTAutograd's partitioner chooses what a compiled graph saves and
    recomputes, and it need not be what the eager candidate does (torch 2.11
    to 2.13 save the CPU generator state of a checkpoint whose CPU attention is
    recomputed; a save region's graph may keep fewer tensors; a min-cut
    candidate exists only compiled). Each candidate runs compiled with the
    budget's options on the block's inputs once per block signature (the
    block's class, its parameters' and inputs' shapes and dtypes: the layers of
    a transformer share one), its graph dropped at once: the difference of its
    bytes to the eager ones is added to the eager bytes of every block of that
    signature. Its recompute time is what its compiled forward and backward
    (gradients returned, not accumulated) take beyond those of ``"none"``, the
    least of ``5 * repeats`` timed runs (after those that compile), the
    candidates timed in turn. One graph per candidate and signature is
    compiled for pricing, apart from the graphs the blocks then run."""

    def __init__(self, options: tuple[tuple[str, Any], ...]) -> None:
        self.options = options
        self.by_signature: dict[Any, tuple[dict[str, int], dict[str, float]]] = {}
        self.eager_full: dict[int, int] = {}
        self._calls: dict[float | None, Any] = {}

    def _call(self, memory_budget: float | None) -> Any:
        call = self._calls.get(memory_budget)
        if call is None:
            call = torch.compile(_compiled_side_pass,
                                 **compile_options(self.options, memory_budget))
            self._calls[memory_budget] = call
        return call

    def measure(
        self, installer: BlockInstaller, index: int, cands: list[Candidate],
        args: tuple, kwargs: dict, eager: dict[str, tuple[int, float]],
        restore: Any, params: set[Any], repeats: int,
    ) -> tuple[dict[str, int], dict[str, float]]:
        """``({decision: compiled bytes - eager bytes}, {decision: recompute
        seconds compiled})`` of block ``index``'s candidates."""
        name, module = installer.blocks[index]
        sig = _signature(module, (args, kwargs))
        known = self.by_signature.get(sig)
        if known is not None:
            return known
        from remat_dist._torch import _dynamo

        run = installer.runner(f"{name}[budget profile]")
        deltas: dict[str, int] = {}
        spent: dict[str, float] = {}
        weights = [p for p in module.parameters() if p.requires_grad]

        def once(cand: Candidate, timed: bool) -> tuple[int, float]:
            a, kw = restore()
            call = self._call(cand.memory_budget)
            fn = call_block if cand.regions is None else run
            clock = time.process_time
            t0 = clock()
            with Counter(params, chain=False) as count:
                if cand.regions is None:
                    out = call(fn, module, cand.label, a, kw)
                else:
                    with installer.regions_kept(index, cand.regions):
                        out = call(fn, module, cand.label, a, kw)
            if timed:
                outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                        and t.requires_grad]
                wrt = [t for t in tree_leaves((a, kw)) if isinstance(t, torch.Tensor)
                       and t.requires_grad and t.is_leaf] + weights
                if outs and wrt:
                    torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs],
                                        allow_unused=True)
            took = clock() - t0
            del out, a, kw
            return count.total, took

        # one graph per candidate: the label is a guard (the save regions the
        # side pass installs are module patches Dynamo does not guard on)
        with _dynamo.cache_size_limit_at_least(8 + 2 * len(cands)):
            for cand in cands:
                total, _ = once(cand, timed=False)  # compiles it
                deltas[cand.label] = total - eager[cand.label][0]
                once(cand, timed=True)  # compiles its backward
            # a compiled block's step is short: five times the timed runs, the
            # candidates in turn (a busy machine slows them alike)
            for _ in range(5 * repeats):
                for cand in cands:
                    took = once(cand, timed=True)[1]
                    spent[cand.label] = min(spent.get(cand.label, took), took)
        base = spent.get("none", 0.0)
        times = {label: 0.0 if label == "none" else max(0.0, t - base)
                 for label, t in spent.items()}
        self.by_signature[sig] = (deltas, times)
        return deltas, times


def _compiled_side_pass(fn: Any, module: nn.Module, label: str, args: tuple, kwargs: dict) -> Any:
    if label == "":  # never true: makes Dynamo guard on the label
        raise AssertionError("a candidate without a label")
    return fn(module, *args, **kwargs)


def _signature(module: nn.Module, inputs: Any) -> Any:
    def meta(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return (tuple(t.shape), t.dtype, t.device.type, t.requires_grad)
        return type(t).__name__

    return (
        type(module),
        tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()),
        tuple(meta(x) for x in tree_leaves(inputs)),
    )


def _snapshot_buffers(module: nn.Module) -> list[list[Any]]:
    """``[owner, name, tensor, copy, version]`` of every buffer of ``module`` and
    its submodules, for :func:`_restore_buffers`."""
    out = []
    seen: set[int] = set()
    for sub in module.modules():
        for key, buf in buffers_of(sub).items():
            if buf is None:
                continue
            with torch.no_grad():
                copy = None if id(buf) in seen else buf.detach().clone()
            seen.add(id(buf))
            out.append([sub, key, buf, copy, buf._version])
    return out


def _restore_buffers(snapshot: list[list[Any]]) -> None:
    """Undo the side passes' buffer updates: the same tensor objects (reassigned
    ones put back), with their values copied back in place where they changed (an
    untouched buffer keeps its version: autograd may have saved it). Kernels such
    as batch norm update their buffers without a version bump, hence the values
    compared too."""
    with torch.no_grad():
        for entry in snapshot:
            sub, key, buf, copy, version = entry
            if buffers_of(sub).get(key) is not buf:
                buffers_of(sub)[key] = buf
            if copy is None:
                continue
            same = (
                buf._version == version
                and type(buf) is torch.Tensor
                and torch.equal(buf, copy)
            )
            if not same:
                buf.copy_(copy)
                entry[4] = buf._version


def _copy_input(x: Any, *, params: set[Any]) -> Any:
    """A side pass's copy of one input leaf, so that the block's in-place updates
    of its inputs stay in the copy: plain tensors get a new storage of the same
    size at the same offset and strides (the bytes counted stay those of the real
    input); ``requires_grad`` as the original, and a non-leaf for a non-leaf (an
    in-place update of a leaf that requires grad would raise). Parameters and
    non-tensors are passed as they are."""
    if not isinstance(x, torch.Tensor) or isinstance(x, nn.Parameter):
        return x
    local = plain(x)
    if (local.device, local.untyped_storage()._cdata) in params:
        return x
    if type(x) is not torch.Tensor or x.layout != torch.strided or x.is_meta:
        leaf = x.detach().clone().requires_grad_(x.requires_grad)
        return leaf.clone() if x.grad_fn is not None else leaf

    def make() -> torch.Tensor:
        with torch.no_grad():
            storage = x.untyped_storage()
            fresh = torch.UntypedStorage(storage.nbytes(), device=x.device)
            fresh.copy_(storage)
            out = torch.empty(0, dtype=x.dtype, device=x.device)
            return out.set_(fresh, x.storage_offset(), x.size(), x.stride())

    if x.grad_fn is not None:
        anchor = torch.zeros((), device=x.device, requires_grad=True)
        return _NonLeaf.apply(anchor, make)
    return make().requires_grad_(x.requires_grad)


class _NonLeaf(torch.autograd.Function):
    """``make()`` as a non-leaf that requires grad (its graph ends here)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, make: Any) -> torch.Tensor:
        return make()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        return None, None


def _time_block(
    module: nn.Module,
    paths: list[str],
    restore: Any,
    repeats: int,
) -> tuple[float, dict[str, float]]:
    """Minimum over ``repeats`` of the block's grad-enabled forward time (what a
    replay runs) and of each region's calls inside it; ``restore()`` puts the
    state back and gives fresh ``(args, kwargs)`` before each pass."""
    args, kwargs = restore()
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in tree_leaves((args, kwargs)))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # CPU: this process's CPU time, blind to other processes sharing the cores
    # (a busy machine); an accelerator: wall time after a device sync.
    clock = time.perf_counter if cuda else time.process_time
    starts: dict[str, float] = {}
    region_s = {p: float("inf") for p in paths}
    block_s = float("inf")
    current: dict[str, float] = {}
    handles = []
    for path in paths:
        sub = module.get_submodule(path)

        def pre(m: nn.Module, a: Any, path: str = path) -> None:
            sync()
            starts[path] = clock()

        def post(m: nn.Module, a: Any, o: Any, path: str = path) -> None:
            sync()
            current[path] = current.get(path, 0.0) + clock() - starts[path]

        handles.append(sub.register_forward_pre_hook(pre))
        handles.append(sub.register_forward_hook(post))
    try:
        for i in range(repeats):
            if i:
                args, kwargs = restore()
            current.clear()
            sync()
            t0 = clock()
            # innermost identity hooks: the model's counter must not see this pass
            route = bare_hooks_extent()  # no Python hook in backend work
            try:
                with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                    out = call_block(module, *args, **kwargs)
            finally:
                route.pop()
            sync()
            block_s = min(block_s, clock() - t0)
            del out, args, kwargs
            for p in paths:
                region_s[p] = min(region_s[p], current.get(p, 0.0))
    finally:
        for h in handles:
            h.remove()
    return block_s, region_s


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t
