#!/usr/bin/env bash
# Train a recipe: ./run_train.sh RECIPE [--section.key=value ...]
# NGPU=N runs N processes under torchrun (N GPUs, or N CPU processes over gloo without CUDA).
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: [NGPU=N] $0 RECIPE [--section.key=value ...]" >&2
    exit 2
fi
NGPU=${NGPU:-1}
if [ "$NGPU" -le 1 ]; then
    exec python -m kiln.recipes.cli train "$@"
fi
# One intra-op thread per process unless told otherwise (torchrun's default, without its banner).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# torchrun with kiln's error reporting: one message and kiln's exit status whichever rank failed
exec python -m kiln.recipes.launch --standalone --nnodes=1 --nproc-per-node="$NGPU" \
    --local-ranks-filter="${LOG_RANK:-0}" \
    -m kiln.recipes.cli train "$@"
