#!/usr/bin/env bash
# GPU throughput check: ~1B dense recipe, a few dozen steps each in bf16 eager, bf16 + compile and
# fp8 rowwise + compile; prints tokens/s, MFU and peak memory as one table.
#   scripts/gpu_check.sh [--steps N] [--warmup N] [--only 1,3] [--section.key=value ...]
# NGPU=N uses N GPUs (FSDP2). Run from anywhere; it runs in the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible; this check is for GPU machines")
cap = torch.cuda.get_device_capability()
print(f"gpu_check: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), torch {torch.__version__}, "
      f"{torch.cuda.device_count()} GPU(s)")
try:
    import torchao
    print(f"gpu_check: torchao {torchao.__version__}")
except ImportError:
    print("gpu_check: torchao missing: the fp8 row will fail")
PY
exec python scripts/gpu_check.py "$@"
