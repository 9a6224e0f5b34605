#!/usr/bin/env bash
# Multi-node GPU launch of launchers/train.py (an example; not run by CI).
#
# Run the same command on every node. torchrun's c10d rendezvous needs one host
# that all nodes reach (RDZV_HOST, e.g. the first node) and a job id they share.
# One process per GPU; NCCL is chosen automatically when CUDA is present.
#
#   NNODES=2 RDZV_HOST=node0.example JOB_ID=gpt-remat launchers/multinode_gpu.sh --tp 8 --remat attention
#
# Environment:
#   NNODES          number of nodes (default 1)
#   GPUS_PER_NODE   processes per node (default: every visible GPU)
#   RDZV_HOST       rendezvous host[:port] (default localhost:29500)
#   JOB_ID          rendezvous id shared by the nodes (default remat-dist)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
RDZV_HOST="${RDZV_HOST:-localhost:29500}"
JOB_ID="${JOB_ID:-remat-dist}"
exec torchrun \
    --nnodes "$NNODES" \
    --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$RDZV_HOST" \
    --rdzv-id "$JOB_ID" \
    launchers/train.py --device cuda "$@"
