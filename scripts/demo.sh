#!/usr/bin/env bash
# Run the main job: the reference GPT trained with FSDP2 and per-block activation
# checkpointing on 2 ranks (torchrun, CPU + gloo). scripts/demo.sh [TRAIN ARGS...]
#
# Creates .venv if missing and installs the project (skipped when already done).
# Extra arguments go to launchers/train.py (default: --steps 30).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
ensure_venv
cd "$ROOT"
if [[ -z "${GLOO_SOCKET_IFNAME:-}" && -e /sys/class/net/lo ]]; then
    # Both ranks are on this machine: talk over loopback, whatever the hostname
    # resolves to.
    export GLOO_SOCKET_IFNAME=lo
fi
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    # Half the cores for each of the 2 ranks (torchrun would warn and pick 1).
    cores="$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)"
    export OMP_NUM_THREADS=$(( cores / 2 > 0 ? cores / 2 : 1 ))
fi
# torch warns at import when numpy is absent; the demo does not need numpy.
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore:Failed to initialize NumPy}"
if [[ $# -eq 0 ]]; then
    set -- --steps 30
fi
exec "$VENV/bin/torchrun" --standalone --nproc-per-node 2 launchers/train.py "$@"
