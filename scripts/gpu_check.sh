#!/usr/bin/env bash
# The one-call GPU check for a machine without network (the lent H200 image: Python 3.12,
# torch 2.11 + CUDA 13 preinstalled; no torchao, torchdata, pydantic, tomli-w):
#   1. installs the wheels that scripts/gpu_wheels.sh downloaded (WHEELS, default .whl/) and kiln
#      itself into a private folder (SITE) with --no-index --no-deps, on top of the image's
#      packages (PYTHONPATH: nothing of the image is changed);
#   2. checks the environment (torch in kiln's declared range, CUDA, every import);
#   3. runs scripts/gpu_check.py: the table of tokens/s, MFU, memory and the peer ratio, written
#      to $OUT (gpu_check.json, gpu_check.md, gpu_check.log) when OUT is set, else runs/gpu_check.
#
#   scripts/gpu_check.sh [--cpu] [gpu_check.py options, e.g. --only dense --steps 10]
# --cpu: the CPU dry run of the same steps at tiny size (what CI runs, so this cannot rot).
# The whole GPU run is sized to finish inside 8 minutes (gpu_check.py --budget, default 420 s).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/kiln-site}
MODE=gpu
if [[ "${1:-}" == "--cpu" ]]; then MODE=cpu; shift; fi
start=$(date +%s)

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if (( ${#wheels[@]} == 0 )); then
    echo "gpu_check: no wheels in $WHEELS/; run scripts/gpu_wheels.sh on a machine with the" \
         "package registry first and carry the folder along" >&2
    exit 2
fi
# Wheels built for another interpreter (gpu_wheels.sh makes cp312 ones, for the GPU image) would
# fail inside pip with a terse message; say what to do instead.
"$PY" - "${wheels[@]}" <<'PY'
import sys
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

here = set(sys_tags())
bad = [w for w in sys.argv[1:] if not here & set(parse_wheel_filename(w.rsplit("/", 1)[-1])[3])]
if bad:
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    sys.exit(f"gpu_check: {', '.join(bad)} cannot install on this Python {v}; run "
             f"scripts/gpu_wheels.sh --python-version {v} --dest DIR and set WHEELS=DIR, or set "
             "PYTHON to a Python the wheels are for")
PY
rm -rf "$SITE"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "${wheels[@]}"
# kiln itself from this checkout, built with the carried setuptools ($WHEELS/build/).
"$PY" -m pip install -q --no-index --find-links "$WHEELS/build" --no-deps --no-compile \
    --no-cache-dir --target "$SITE" .
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu_check: installed ${#wheels[@]} wheels + kiln into $SITE in $(( $(date +%s) - start )) s"

"$PY" - "$MODE" <<'PY'
import importlib, importlib.metadata as md, sys
import torch
from packaging.requirements import Requirement
from packaging.version import Version

mode = sys.argv[1]
print(f"gpu_check: python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}")
bad = []
for text in md.requires("kiln"):
    req = Requirement(text)
    if req.marker is not None:  # extras (dev)
        continue
    have = Version(md.version(req.name).split("+")[0])
    ok = req.specifier.contains(have, prereleases=True)
    print(f"gpu_check:   {req.name} {have} (kiln needs {req.specifier}){'' if ok else ' <- NO'}")
    if not ok:
        bad.append(f"{req.name} {have} not in {req.specifier}")
if any(b.startswith("torch ") for b in bad):  # the others: warn, and let the imports decide
    sys.exit("gpu_check: outside kiln's declared ranges: " + "; ".join(bad))
if bad:
    print("gpu_check: WARNING, outside kiln's declared ranges: " + "; ".join(bad))
for name in ("kiln.recipes.training.trainer", "kiln.parallelisms", "torchao.float8", "torchdata",
             "pydantic", "tomli_w", "numpy", "safetensors", "huggingface_hub", "tqdm", "xxhash"):
    importlib.import_module(name)
if mode == "gpu":
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible; use --cpu for the CPU dry run")
    cap = torch.cuda.get_device_capability()
    print(f"gpu_check: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), "
          f"{torch.cuda.device_count()} GPU(s)")
PY

if [[ "$MODE" == cpu ]]; then
    exec "$PY" scripts/gpu_check.py --tiny --device cpu --steps 2 --warmup 1 "$@"
fi
exec "$PY" scripts/gpu_check.py "$@"
