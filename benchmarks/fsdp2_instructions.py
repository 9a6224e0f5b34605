"""remat_dist against ``torch.utils.checkpoint`` under FSDP2, in instructions executed.

``benchmarks.fsdp2_overhead`` times the two in CPU time, where this 2-core box's noise
is as large as the difference (two instances of the same torch variant differ by up
to half a percent). This script counts what each executes instead, which does not
depend on the machine's load: the same model, layout and checkpoint placement (the
reference GPT, dim 128, 4 blocks, seq 64, batch 4, FSDP2 units per block, the
checkpoint inside each unit, a 1-rank gloo group), run under valgrind's callgrind
with instrumentation switched on only around the measured forwards or backwards
(after 3 warm-up steps, garbage collection off while measuring). It prints the
instructions per step of each variant, forward and backward apart, their ratio, and
writes JSON.

Instructions are not time: a cache miss or a page fault costs time and no
instruction. What the count settles is whether remat_dist's own code executes more
than torch's checkpoint does for the same step.

Needs ``valgrind`` on PATH; a run takes about 10 minutes (the program runs some 50
times slower under valgrind, also where nothing is counted).

    python -m benchmarks.fsdp2_instructions [--steps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks._torchrun import with_root

VARIANTS = ("torch.utils.checkpoint", "remat_dist")
PHASES = ("forward", "backward")
_INNER = "REMAT_DIST_CALLGRIND_INNER"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="measured steps per variant")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if os.environ.get(_INNER):
        _measure(args.steps)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit(
            "benchmarks.fsdp2_instructions needs valgrind (callgrind) on PATH: install "
            "it (apt-get install valgrind) or use benchmarks.fsdp2_overhead for times."
        )
    with tempfile.TemporaryDirectory() as out:
        env = with_root(**{_INNER: "1", "PYTHONHASHSEED": "0"})
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}/cg.%p",
            sys.executable,
            "-m",
            "benchmarks.fsdp2_instructions",
            "--steps",
            str(args.steps),
        ]
        log = os.path.join(out, "valgrind.log")
        with open(log, "w") as err:
            code = subprocess.run(cmd, env=env, stderr=err).returncode
        try:
            if code != 0:
                sys.exit(
                    f"the measured run failed with exit code {code} (valgrind's last "
                    "lines are above)"
                )
            counts = _read_dumps(out)
        except SystemExit:
            with open(log) as err:
                sys.stderr.write("".join(err.readlines()[-40:]))
            raise
    rows: dict[str, Any] = {}
    print(f"instructions per step ({args.steps} measured steps per variant)")
    print(f"{'phase':10s} {'torch':>14s} {'remat':>14s} {'x torch':>9s} {'remat - torch':>14s}")
    for phase in (*PHASES, "step"):
        if phase == "step":
            base = sum(counts[(VARIANTS[0], p)] for p in PHASES)
            mine = sum(counts[(VARIANTS[1], p)] for p in PHASES)
        else:
            base, mine = counts[(VARIANTS[0], phase)], counts[(VARIANTS[1], phase)]
        base, mine = base / args.steps, mine / args.steps
        rows[phase] = {"torch": base, "remat": mine, "x_torch": mine / base}
        print(f"{phase:10s} {base:14,.0f} {mine:14,.0f} {mine / base:9.4f} {mine - base:+14,.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "rows": rows}, f, indent=1)


def _measure(steps: int) -> None:
    """Runs under callgrind: builds both variants, then counts each phase."""
    import gc

    import torch.distributed as dist

    from benchmarks.dist import one_rank_fsdp2_bench
    from remat_dist.models import make_batch

    config, build = one_rank_fsdp2_bench(port=29695)
    pid = str(os.getpid())

    def control(*flags: str) -> None:
        subprocess.run(["callgrind_control", *flags, pid], capture_output=True, check=True)
        time.sleep(0.5)  # callgrind reads the command at its next check

    try:
        models = {v: build(v) for v in VARIANTS}
        tokens, targets = make_batch(config, 4, seed=0)
        for model in models.values():
            for _ in range(3):
                model.loss(tokens, targets).backward()
                model.zero_grad(set_to_none=True)
        gc.collect()
        gc.disable()
        for index, model in enumerate(models.values()):
            for phase in PHASES:
                control("--zero")
                for _ in range(steps):
                    if phase == "forward":
                        control("--instr=on")
                    loss = model.loss(tokens, targets)
                    if phase == "forward":
                        control("--instr=off")
                    else:
                        control("--instr=on")
                    loss.backward()
                    if phase == "backward":
                        control("--instr=off")
                    model.zero_grad(set_to_none=True)
                control(f"--dump=variant{index}-{phase}")  # one word: a shell reads it
    finally:
        dist.destroy_process_group()


def _read_dumps(out: str) -> dict[tuple[str, str], int]:
    """Total instructions of each labelled dump (the sum of every function's own
    cost: callgrind's ``summary`` line reads 0 after ``--zero``)."""
    counts: dict[tuple[str, str], int] = {}
    for name in os.listdir(out):
        label, total, after_call = None, 0, False
        with open(os.path.join(out, name)) as f:
            for line in f:
                if line.startswith("desc: Trigger: dump "):
                    label = line.split("dump ", 1)[1].strip()
                elif line.startswith("calls="):
                    after_call = True  # the next cost line is the call's inclusive cost
                elif re.match(r"[0-9+\-*]", line):
                    fields = line.split()
                    if len(fields) >= 2 and not after_call:
                        total += int(fields[1])
                    after_call = False
        found = re.fullmatch(r"variant(\d+)-(\w+)", label or "")
        if found:
            counts[(VARIANTS[int(found.group(1))], found.group(2))] = total
    missing = [(v, p) for v in VARIANTS for p in PHASES if (v, p) not in counts]
    if missing:
        sys.exit(f"callgrind wrote no dump for {missing} (valgrind's last lines are above)")
    return counts


if __name__ == "__main__":
    main()
