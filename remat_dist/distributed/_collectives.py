"""Observe, verify and serve every collective issued inside a dynamic extent.

This is the building block of remat_dist's collective ledger: a checkpoint records the
collectives its forward issues (:class:`RecordCollectives`), and its replay either
re-issues them while checking each one against the ledger *before* it is issued
(:class:`VerifyCollectives`) or issues none and hands back the outputs kept on forward
(:class:`ServeCollectives`, "comm-free replay"). An observer is active inside
``with observe_collectives(observer): ...`` on the calling thread only.

What is caught, and how
=======================

Every collective (torch 2.11 to 2.15) ends up as a call of a ``c10d::`` dispatcher op
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
``Python`` (from torch 2.13): inside a ``__torch_dispatch__`` (DTensor's, a
``TorchDispatchMode``'s) every key above ``Python`` is excluded
(``TESTING_ONLY_GenericMode``, tried first, missed DTensor's implicit
redistributions for that reason), the keys below are not. On torch 2.11 and 2.12
``Fake`` is above ``Python``, and a later torch may give ``Fake`` kernels or a
fallback: there the kernels are registered at ``BackendSelect`` instead (always
reached, below ``Python`` too; they then check a thread-local and pass through, a
few microseconds per collective when no extent is active).
``interception_key()`` says which is in use.

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

Where the rest lives
===================

``_optable`` (what each op writes, reads and compares), ``_intercept`` (the kernels,
the observer stack, the step hooks), ``_ledger`` (entries and ledgers),
``_verify`` (record, verify, serve; releasing peers on divergence), ``_step`` (the
agreements and end-of-backward reports among the ranks at stake, on
``_stake_group``'s gloo groups) and ``_replay`` (the
checkpoint observer tying them together). This module is their front door.
"""

from remat_dist.distributed._intercept import (
    CollectiveCall,
    CollectiveObserver,
    interception_key,
    observe_collectives,
)
from remat_dist.distributed._ledger import CollectiveEntry, CollectiveLedger
from remat_dist.distributed._optable import TensorMeta
from remat_dist.distributed._verify import (
    RecordCollectives,
    ServeCollectives,
    VerifyCollectives,
)

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
