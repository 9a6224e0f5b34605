#!/usr/bin/env bash
# GPU checks: scripts/gpu_check.sh [PYTEST ARGS...]
#
# Runs the tests marked `gpu` (CUDA RNG snapshots, per-rank device choice, DTensor's
# CUDA RNG tracker) and prints a summary. They need a CUDA build of torch, which the
# project's .venv (pinned to the CPU build) does not have on a CPU machine, so the
# interpreter is, in order: $PYTHON; .venv/bin/python if its torch sees CUDA;
# python3 on PATH if its torch sees CUDA; else .venv as it is (set up the way
# scripts/test.sh does only when it is missing).
# The checkout goes on PYTHONPATH, so an interpreter without the project installed
# works. Exit code: pytest's; 3 when CUDA is not available (every check would skip).
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
if not torch.cuda.is_available():
    print("CUDA is not available: every gpu check would be skipped")
    sys.exit(3)
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i} {torch.cuda.get_device_name(i)}")
EOF
rc=$?
[[ $rc -ne 0 ]] && exit "$rc"

start=$SECONDS
timeout 300 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "$@"
rc=$?
echo "=== GPU check: pytest exit code $rc in $((SECONDS - start)) s ==="
if [[ $rc -eq 5 ]]; then
    echo "no gpu test was collected" >&2
fi
exit "$rc"
