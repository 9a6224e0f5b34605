"""``python -m benchmarks.transport``: what one round of the agreement costs, on the
library's transport and on two others, side by side in one run.

At each rank count (``--ranks``, default 1 2 4 8: processes on this machine under
torchrun, gloo over loopback) three designs run the agreement's round (6 int64,
element-wise max; ``benchmarks._transport_rank`` says what each runs):

* (a) ``stake group``: ``StakeGroup.reduce_max``, what the library issues
  (recursive doubling on gloo's ``send``/``recv``);
* (b) ``plain gloo``: ``dist.all_reduce`` on ``dist.new_group(ranks,
  backend="gloo")``: torch's own API, the floor (a) is measured against;
* (c) ``old side channel``: the hand-written socket layer the stake groups
  replaced, loaded at run time from git (``--old-rev``, default 4de3215: its
  ``_channel.py`` and ``_wire.py`` into a temporary package); skipped, with a
  line saying why, where the checkout has no such history.

Per rank count: ``--samples`` samples of ``--rounds`` rounds per design, the
designs' order rotating from sample to sample; a sample's figure is the slower
rank's milliseconds per round. Each design's median with a seeded bootstrap 95%
interval, and the ratios (a)/(b) and (a)/(c): the median over samples of the
within-sample ratio, with its interval.

Ranks beyond this machine's cores share them: the 4- and 8-rank figures then
measure the oversubscription as much as the transport. The model (printed after
the table) takes what one *hop* costs from the 1- and 2-rank figures, where each
rank has a core: gloo's all_reduce of a CPU tensor is its ring algorithm (torch
2.13's ``ProcessGroupGloo`` calls ``gloo::allreduce`` with no algorithm set, which
runs ``ring``: a reduce-scatter then an all-gather, each ``n - 1`` dependent
hops, so ``2 (n - 1)`` in all); the stake group and the old side channel are
recursive doubling (``log2 n`` exchanges, two more where ``n`` is no power of
two). A round among
``n`` ranks with a core each is then ``fixed + hops(n) * hop``, ``fixed`` being
the 1-rank figure (no hop: the call's own cost). The 16,384-rank rows apply it:
stakes share nothing (no server, no link), so a stake of ``TP`` ranks costs its
``TP``-rank round whatever the world size, two rounds per step (the agreement and
the end-of-backward report).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks._output import write_json
from benchmarks._torchrun import ROOT, run_worker
from benchmarks._transport_rank import (
    DESIGNS,
    OLD,
    OLD_FILES,
    PACKAGE,
    PLAIN,
    STAKE,
    import_old_channel,
)
from benchmarks.dist import _median_ci95

__all__ = ["format_transport", "main", "run_transport"]

OLD_REV = "4de3215"
"""The last commit with the side channel (``remat_dist/distributed/_channel.py``)."""
WORLD = 16384
LAYOUTS = ((2, "PP=16 x DP=512 x TP=2"), (4, "PP=16 x DP=256 x TP=4"),
           (8, "PP=16 x DP=128 x TP=8"))
"""The 16,384-rank layouts modelled: a stake per TP group."""


def load_old_channel(folder: str, rev: str = OLD_REV) -> str | None:
    """Write the old side channel of ``rev`` into ``folder/PACKAGE`` and import it
    once here; None where it worked, else why not (no git, no such history)."""
    package = os.path.join(folder, PACKAGE)
    os.makedirs(package, exist_ok=True)
    for name in OLD_FILES:
        path = f"remat_dist/distributed/{name}"
        try:
            proc = subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{rev}:{path}"],
                capture_output=True, text=True, timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"git is not available here ({e})"
        if proc.returncode != 0:
            return f"git show {rev}:{path} failed: {proc.stderr.strip()[:200]}"
        source = proc.stdout.replace("from remat_dist.distributed._wire import", "from ._wire import")
        with open(os.path.join(package, name), "w") as f:
            f.write(source)
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write(f'"""The side channel of remat_dist at {rev} (benchmarks.transport)."""\n')
    try:
        import_old_channel(folder)
    except Exception as e:  # noqa: BLE001 - any reason it no longer imports
        return f"the side channel of {rev} does not import: {type(e).__name__}: {e}"
    return None


def hops(design: str, n: int) -> int:
    """Dependent one-way hops of one round among ``n`` ranks (see the docstring)."""
    if n < 2:
        return 0
    if design in (OLD, STAKE):
        p = 1 << (n.bit_length() - 1)
        return int(math.log2(p)) + (2 if n != p else 0)
    return 2 * (n - 1)


def _summary(n: int, raw: dict[str, Any]) -> dict[str, Any]:
    """Rows of one rank count from every rank's samples: per sample the slower
    rank's time."""
    ranks = raw["ranks"]
    designs = [d for d in DESIGNS if d in ranks[0]["samples"]]
    count = len(ranks[0]["samples"][designs[0]])
    per = {d: [max(r["samples"][d][s] for r in ranks) * 1e3 for s in range(count)]
           for d in designs}
    out: dict[str, Any] = {"ranks": n, "designs": {}, "ratios": {}}
    for d in designs:
        out["designs"][d] = {
            "round_ms": statistics.median(per[d]),
            "round_ms_ci95": _median_ci95(per[d]),
            "samples_ms": per[d],
            "store_requests": sum(r["store_requests"].get(d, 0) for r in ranks),
        }
    for other, key in ((PLAIN, "stake/plain"), (OLD, "stake/old")):
        if other in per:
            ratios = [a / b for a, b in zip(per[STAKE], per[other])]
            out["ratios"][key] = {
                "median": statistics.median(ratios), "ci95": _median_ci95(ratios)
            }
    return out


def model(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per design: the fixed cost (1-rank figure, 0 if not run) and one hop (from
    the 2-rank figure); modelled rounds at each rank count; the 16,384-rank rows."""
    by_n = {r["ranks"]: r["designs"] for r in rows}
    if 2 not in by_n:
        return {}
    out: dict[str, Any] = {"fixed_ms": {}, "hop_ms": {}, "rounds": [], "world": []}
    for d, two in by_n[2].items():
        fixed = by_n[1][d]["round_ms"] if 1 in by_n and d in by_n[1] else 0.0
        out["fixed_ms"][d] = fixed
        out["hop_ms"][d] = max(0.0, two["round_ms"] - fixed) / hops(d, 2)

    def round_ms(d: str, n: int) -> float:
        return out["fixed_ms"][d] + hops(d, n) * out["hop_ms"][d]

    for n in sorted(by_n):
        for d in by_n[n]:
            out["rounds"].append({
                "ranks": n, "design": d, "hops": hops(d, n),
                "modelled_ms": round_ms(d, n), "measured_ms": by_n[n][d]["round_ms"],
            })
    for tp, layout in LAYOUTS:
        for d in (STAKE, OLD):
            if d not in out["hop_ms"]:
                continue
            measured = by_n.get(tp, {}).get(d)
            out["world"].append({
                "layout": layout, "ranks": WORLD, "stake_ranks": tp,
                "stakes": WORLD // tp, "design": d,
                "step_ms_modelled": 2 * round_ms(d, tp),
                "step_ms_measured": 2 * measured["round_ms"] if measured else None,
                "store_requests_per_step": 0,
            })
    out["world"].append({
        "layout": "FSDP2 only (no TP)", "ranks": WORLD, "stake_ranks": 0, "stakes": 0,
        "design": "no stake", "step_ms_modelled": 0.0, "step_ms_measured": 0.0,
        "store_requests_per_step": 0,
    })
    return out


def run_transport(
    ranks: tuple[int, ...] = (1, 2, 4, 8),
    *,
    rounds: int = 200,
    samples: int = 15,
    warmup: int = 50,
    timeout: float = 60.0,
    old_rev: str | None = OLD_REV,
    progress: Any = None,
) -> dict[str, Any]:
    """Every rank count of ``ranks``; the JSON document."""
    from benchmarks.core import environment

    progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory() as folder:
        skipped = load_old_channel(folder, old_rev) if old_rev else "not asked for"
        if skipped:
            progress(f"(c) {OLD}: skipped: {skipped}")
        cfg = {"rounds": rounds, "samples": samples, "warmup": warmup, "timeout": timeout,
               "old_folder": None if skipped else folder}
        rows = []
        for n in ranks:
            t0 = time.monotonic()
            raw = run_worker("benchmarks._transport_rank", n, cfg, f"transport, {n} ranks")
            rows.append(_summary(n, raw))
            progress(f"  {n} ranks: {time.monotonic() - t0:.0f} s")
    return {
        "environment": {**environment(), "cpus": os.cpu_count()},
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "config": {"ranks": list(ranks), "rounds": rounds, "samples": samples,
                   "warmup": warmup, "old_rev": old_rev, "payload": "6 int64, MAX"},
        "old_side_channel": "measured" if not skipped else f"skipped: {skipped}",
        "rows": rows,
        "model": model(rows),
    }


def _ci(x: dict[str, Any], value: str = "round_ms", ci: str = "round_ms_ci95") -> str:
    lo, hi = x[ci]
    return f"{x[value]:7.3f} [{lo:.3f}, {hi:.3f}]"


def format_transport(result: dict[str, Any]) -> str:
    """The measured table, the model, and the 16,384-rank rows."""
    cfg = result["config"]
    designs = [d for d in DESIGNS if any(d in r["designs"] for r in result["rows"])]
    head = f"{'ranks':>5}" + "".join(f"  {d:>24}" for d in designs)
    head += f"  {'(a)/(b)':>23}" + (f"  {'(a)/(c)':>23}" if OLD in designs else "")
    lines = [
        f"one round (6 int64, max): ms per round, median of {cfg['samples']} samples of "
        f"{cfg['rounds']} rounds (the slower rank's) [95% interval]; "
        "(a) stake group, (b) plain gloo, (c) old side channel",
        head, "-" * len(head),
    ]
    for r in result["rows"]:
        cells = "".join(
            f"  {_ci(r['designs'][d]):>24}" if d in r["designs"] else f"  {'-':>24}"
            for d in designs
        )
        for key in ("stake/plain", "stake/old"):
            if key == "stake/old" and OLD not in designs:
                continue
            ratio = r["ratios"].get(key)
            cells += f"  {_ci(ratio, 'median', 'ci95'):>23}" if ratio else f"  {'-':>23}"
        lines.append(f"{r['ranks']:>5}" + cells)
    requests = {d: sum(r["designs"][d]["store_requests"] for r in result["rows"]
                       if d in r["designs"]) for d in designs if d != PLAIN}
    lines.append("store requests while sampling (all ranks, all samples): " + ", ".join(
        f"{d} {n}" for d, n in requests.items()
    ))
    if result["old_side_channel"] != "measured":
        lines.append(f"(c) {OLD}: {result['old_side_channel']}")
    m = result["model"]
    if not m:
        return "\n".join(lines)
    lines.append(
        "\nmodel, a core per rank: round(n) = fixed + hops(n) x hop; gloo's ring "
        "2(n-1) hops; the stake group's and the side channel's recursive doubling log2(n)"
    )
    for d in m["hop_ms"]:
        lines.append(f"  {d:<17} fixed {m['fixed_ms'][d]:.3f} ms, hop {m['hop_ms'][d]:.3f} ms")
    lines.append(f"  {'ranks':>5} {'design':<17} {'hops':>4} {'modelled ms':>11} {'measured ms':>11}")
    for r in m["rounds"]:
        lines.append(f"  {r['ranks']:>5} {r['design']:<17} {r['hops']:>4} "
                     f"{r['modelled_ms']:>11.3f} {r['measured_ms']:>11.3f}")
    lines.append(f"\n{WORLD:,} ranks, two rounds per step per stake (agreement + report):")
    lines.append(f"  {'layout':<22} {'stakes':>6} {'design':<17} "
                 f"{'ms/step, a core per rank':>24} {'ms/step, here':>13} {'store req/step':>14}")
    for r in m["world"]:
        here = "-" if r["step_ms_measured"] is None else f"{r['step_ms_measured']:.3f}"
        lines.append(
            f"  {r['layout']:<22} {r['stakes']:>6} {r['design']:<17} "
            f"{r['step_ms_modelled']:>24.3f} {here:>13} {r['store_requests_per_step']:>14}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.transport", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=200, help="rounds per sample")
    parser.add_argument("--samples", type=int, default=15, help="samples per design")
    parser.add_argument("--warmup", type=int, default=50, help="rounds before sampling")
    parser.add_argument("--timeout", type=float, default=60.0, help="bound of a round (s)")
    parser.add_argument("--old-rev", default=OLD_REV,
                        help="git revision of the old side channel ('' to skip it)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    result = run_transport(
        tuple(args.ranks), rounds=args.rounds, samples=args.samples, warmup=args.warmup,
        timeout=args.timeout, old_rev=args.old_rev or None,
    )
    print(format_transport(result))
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
