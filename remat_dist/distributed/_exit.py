"""What a process that imported remat_dist does at interpreter exit, while the
interpreter is still whole (an ``atexit`` handler: it runs before finalization).

1. The stakes' gloo groups are dropped (a gloo group freed during finalization
   aborts the process) and the dispatch hooks dropped.
2. Reference cycles are collected. A model built inside a function (``main()``,
   a trainer object) is such a cycle once the function returns: FSDP2's state and
   its module refer to each other, and the state holds its process group. After
   ``destroy_process_group()`` that group then lives on in the cycle, and Python
   would free the cycle only during finalization, where a gloo process group's
   destructor aborts the process ("terminate called without an active
   exception"). A two-rank script whose only oddity is the world group and a
   subgroup held by a cycle past ``destroy_process_group()`` aborted in 3 to 5
   runs of 12 (with one of the two groups held, in none of 12), and in none of
   12 with this collection (``python -m benchmarks.exits --layout cycle``, from
   a checkout). A group still referenced from a live global at exit is beyond this:
   it is freed in finalization whatever runs here.
"""

from __future__ import annotations

import atexit
import gc
import sys

from remat_dist.distributed import _step

__all__: list[str] = []


@atexit.register
def _at_exit() -> None:
    _step.release_process_state()
    if "torch.distributed.distributed_c10d" in sys.modules:
        gc.collect()
