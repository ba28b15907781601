#!/usr/bin/env bash
# Train a recipe: ./run_train.sh RECIPE [--section.key=value ...]
# NGPU=N runs N processes per node under torchrun (N GPUs, or N CPU processes over gloo without
# CUDA). Several nodes: run this on each with the same NNODES and RDZV_ENDPOINT=host:port (any
# node's address; torchrun's c10d rendezvous) and its own NODE_RANK (0 .. NNODES-1); RDZV_ID
# names the job (default kiln). LOG_RANK picks the local ranks whose output is shown (default 0).
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: [NGPU=N] [NNODES=M NODE_RANK=i RDZV_ENDPOINT=host:port] $0 RECIPE" \
        "[--section.key=value ...]" >&2
    exit 2
fi
NGPU=${NGPU:-1}
NNODES=${NNODES:-1}
if [ "$NNODES" -le 1 ] && [ "$NGPU" -le 1 ]; then
    exec python -m kiln.recipes.cli train "$@"
fi
# One intra-op thread per process unless told otherwise (torchrun's default, without its banner).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ "$NNODES" -le 1 ]; then
    RDZV=(--standalone --nnodes=1)
else
    if [ -z "${RDZV_ENDPOINT:-}" ] || [ -z "${NODE_RANK:-}" ]; then
        echo "$0: NNODES=$NNODES needs RDZV_ENDPOINT=host:port (reachable from every node) and" \
            "NODE_RANK=0..$((NNODES - 1)) on each node" >&2
        exit 2
    fi
    RDZV=(--nnodes="$NNODES" --node-rank="$NODE_RANK" --rdzv-backend=c10d
          --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-kiln}")
fi
# torchrun with kiln's error reporting (one message and kiln's exit status whichever rank
# failed); the workers die with it, even on kill -9 (kiln.recipes.runs.launch)
exec python -m kiln.recipes.runs.launch "${RDZV[@]}" --nproc-per-node="$NGPU" \
    --local-ranks-filter="${LOG_RANK:-0}" \
    -m kiln.recipes.cli train "$@"
