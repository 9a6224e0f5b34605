"""What one rank of ``benchmarks.transport`` runs: the three designs of a round,
timed side by side on the same ranks, and the loader of the old side channel.

A *round* is what ``remat_dist.distributed._step`` issues for a plan agreement:
every rank contributes 6 int64 (``tagged_words``: the round's tag, its negation,
the plan digest's two words and theirs) and gets their element-wise maximum. The
designs, each a function ``list[int] -> list[int]``:

* ``stake group``: ``StakeGroup.reduce_max`` (the library's transport: a gloo
  group of the stake's ranks on a ``PrefixStore`` of the job's store);
* ``plain gloo``: ``dist.all_reduce(MAX)`` on ``dist.new_group(ranks,
  backend="gloo")``, torch's own API: the same list in, a tensor made from it,
  the list read back (so both pay the same conversions);
* ``old side channel``: ``SideChannel.reduce_max`` of commit 4de3215 (recursive
  doubling over TCP links of its own), loaded from git by the launcher.

Per sample, every design runs ``rounds`` rounds after a barrier, in an order that
rotates from sample to sample (the machine's drift falls on each alike); a
sample's figure is this rank's seconds per round.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["OLD_FILES", "PACKAGE", "measure"]

PACKAGE = "_remat_dist_old_transport"
"""The name the old side channel is imported under (never ``remat_dist``)."""
OLD_FILES = ("_wire.py", "_channel.py")
"""The old transport's modules, in ``remat_dist/distributed/`` at that revision."""

STAKE, PLAIN, OLD = "stake group", "plain gloo", "old side channel"
DESIGNS = (STAKE, PLAIN, OLD)
_AGREE = 1
"""The agreement's tag in ``_step`` (the report's is 2: the same 6 words)."""


def agreement_words() -> list[int]:
    """A plan agreement's 6 words, as the library sends them (one plan digest's
    two 63-bit words, tagged)."""
    from remat_dist.distributed._stake_group import tagged_words

    digest = hashlib.sha256(b"benchmarks.transport").digest()
    words = [int.from_bytes(digest[i : i + 8], "big") >> 2 for i in (0, 8)]
    return tagged_words(_AGREE, words)


def import_old_channel(folder: str) -> Any:
    """The old ``_channel`` module from ``folder/PACKAGE`` (written there by the
    launcher, its import of ``_wire`` pointed at the package's own copy)."""
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(f"{PACKAGE}._channel")


def _designs(cfg: dict[str, Any], name: str) -> tuple[dict[str, Callable], dict[str, Any]]:
    """Each design's round function on every rank, and the objects that count."""
    import torch
    import torch.distributed as dist

    from remat_dist._torch._c10d import default_store
    from remat_dist.distributed._stake_group import StakeGroup, stake_base

    rank, ranks = dist.get_rank(), tuple(range(dist.get_world_size()))
    timeout = cfg["timeout"]
    store = default_store()
    group = StakeGroup(ranks, rank, store, stake_base(f"bench/{name}", ranks), 0)
    pg = dist.new_group(list(ranks), backend="gloo")

    def plain(values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
        return t.tolist()

    designs: dict[str, Callable] = {
        STAKE: lambda values: group.reduce_max(values, timeout),
        PLAIN: plain,
    }
    counted: dict[str, Any] = {STAKE: group}
    if cfg.get("old_folder"):
        old = import_old_channel(cfg["old_folder"])
        channel = old.SideChannel(ranks, rank, store, f"bench/{name}/channel", timeout)
        designs[OLD] = lambda values: channel.reduce_max(values, timeout)
        counted[OLD] = channel
    return designs, counted


def measure(cfg: dict[str, Any]) -> dict[str, Any]:
    """This rank's samples (seconds per round) per design, its store requests while
    sampling, and whether every round gave the expected maximum."""
    import torch.distributed as dist

    names = [f"transport/{time.time_ns()}"]
    dist.broadcast_object_list(names, src=0)  # new keys per run, the same everywhere
    designs, counted = _designs(cfg, names[0])
    order = [d for d in DESIGNS if d in designs]
    words = agreement_words()
    mine = [w + dist.get_rank() if i == 2 else w for i, w in enumerate(words)]
    want = [w + dist.get_world_size() - 1 if i == 2 else w for i, w in enumerate(words)]
    for d in order:  # set-up (the stake group's rendezvous is at its first round)
        for _ in range(cfg["warmup"]):
            if designs[d](mine) != want:
                raise RuntimeError(f"{d}: a round gave a wrong maximum")
    before = {d: obj.store_requests for d, obj in counted.items()}
    samples: dict[str, list[float]] = {d: [] for d in order}
    for s in range(cfg["samples"]):
        for d in order[s % len(order) :] + order[: s % len(order)]:
            fn = designs[d]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(cfg["rounds"]):
                got = fn(mine)
            samples[d].append((time.perf_counter() - t0) / cfg["rounds"])
            if got != want:
                raise RuntimeError(f"{d}: a round gave a wrong maximum")
    requests = {d: obj.store_requests - before[d] for d, obj in counted.items()}
    for obj in counted.values():
        obj.close()
    return {"samples": samples, "store_requests": requests}


def rank_main(out_path: str, cfg: dict[str, Any]) -> None:
    """One torchrun rank: measure, gather every rank's samples; rank 0 writes."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mine = measure(cfg)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump({"ranks": every}, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from benchmarks._torchrun import rank_args

    rank = rank_args(sys.argv[1:])
    if rank is None:
        raise SystemExit("a rank of benchmarks.transport: run python -m benchmarks.transport")
    rank_main(*rank)
