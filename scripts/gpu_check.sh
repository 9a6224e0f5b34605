#!/usr/bin/env bash
# GPU checks: scripts/gpu_check.sh [PYTEST ARGS...]
#
# One short command (under 5 minutes) on a CUDA machine: the tests marked `gpu`
# (CUDA RNG snapshots, per-rank device choice, DTensor's CUDA RNG tracker, OOM
# observer, NCCL report gather), a 1-GPU benchmark of the core (time and peak CUDA
# memory vs torch.utils.checkpoint) and, with 2+ GPUs, the launcher on NCCL; then
# one summary table. Outputs go to $OUT (default: a temporary folder). They need a CUDA build of torch, which the
# project's .venv (pinned to the CPU build) does not have on a CPU machine, so the
# interpreter is, in order: $PYTHON; .venv/bin/python if its torch sees CUDA;
# python3 on PATH if its torch sees CUDA; else .venv as it is (set up the way
# scripts/test.sh does only when it is missing).
# The checkout goes on PYTHONPATH, so an interpreter without the project installed
# works (torch 2.11 or newer: the GPU machines' own torch 2.11 with CUDA needs
# nothing downloaded). Exit code: pytest's; 1 when remat_dist does not import with
# that torch; 3 when CUDA is not available (every check would skip).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
cd "$ROOT"

has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x "$VENV_PY" ]] && has_cuda "$VENV_PY"; then
        PY="$VENV_PY"
    elif command -v python3 >/dev/null 2>&1 && has_cuda python3; then
        PY="$(command -v python3)"
    else
        [[ -x "$VENV_PY" ]] || ensure_venv test || exit 1
        PY="$VENV_PY"
    fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

echo "=== remat_dist GPU check ==="
"$PY" - <<'EOF'
import sys, torch
print(f"python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}")
try:
    import remat_dist
    from remat_dist._torch import SUPPORTED_TORCH, tested_range
except ImportError as e:
    print(f"remat_dist does not import with this torch: {e}")
    sys.exit(1)
print(f"remat_dist {remat_dist.__version__} (torch{SUPPORTED_TORCH}, tested on "
      f"{tested_range()}) imports")
if not torch.cuda.is_available():
    print("CUDA is not available: every gpu check would be skipped")
    sys.exit(3)
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i} {torch.cuda.get_device_name(i)}")
EOF
rc=$?
[[ $rc -ne 0 ]] && exit "$rc"

OUT="${OUT:-$(mktemp -d)}"
declare -a SUMMARY=()
note() { SUMMARY+=("$(printf '%-26s %-5s %s' "$1" "$2" "$3")"); }

# 1. the GPU-marked tests
start=$SECONDS
timeout 180 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "$@" > "$OUT/pytest.txt" 2>&1
rc=$?
tail -n 15 "$OUT/pytest.txt"
note "pytest -m gpu" "$([[ $rc -eq 0 ]] && echo ok || echo FAIL)" \
    "$(grep -E 'passed|failed|skipped' "$OUT/pytest.txt" | tail -n 1) ($((SECONDS - start)) s)"
final=$rc

# 2. 1-GPU core benchmark: time and peak CUDA memory vs torch.utils.checkpoint
start=$SECONDS
timeout 150 "$PY" -m benchmarks.core --device cuda --dims 512 64 --iters 10 \
    --steady-steps 0 --dist 0 --json "$OUT/bench_gpu.json" > "$OUT/bench.txt" 2>&1
rc=$?
cat "$OUT/bench.txt"
if [[ $rc -eq 0 ]]; then
    line=$("$PY" -m benchmarks._gpu_line "$OUT/bench_gpu.json")
    note "bench, 1 GPU" ok "$line ($((SECONDS - start)) s)"
else
    note "bench, 1 GPU" FAIL "exit $rc"
    final=1
fi

# 3. with 2+ GPUs: the launcher on NCCL
ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [[ "$ngpu" -ge 2 ]]; then
    start=$SECONDS
    timeout 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
        launchers/train.py --device cuda --steps 10 --report-json "$OUT/train.json" \
        > "$OUT/train.txt" 2>&1
    rc=$?
    tail -n 12 "$OUT/train.txt"
    note "launcher, 2 GPUs, NCCL" "$([[ $rc -eq 0 ]] && echo ok || echo FAIL)" \
        "$(grep ' loss ' "$OUT/train.txt" | tail -n 1) ($((SECONDS - start)) s)"
    [[ $rc -ne 0 ]] && final=1
else
    note "launcher, 2 GPUs, NCCL" skip "only $ngpu GPU visible"
fi

echo
echo "=== remat_dist GPU check summary (outputs in $OUT) ==="
printf '%s\n' "${SUMMARY[@]}"
exit "$final"
