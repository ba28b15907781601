#!/usr/bin/env bash
# Download, on a machine that reaches the package registry, the wheels that scripts/gpu_check.sh
# installs on the GPU machine (no network there): scripts/gpu_wheels.txt, cp312 manylinux x86_64
# by default, into .whl/ (git-ignored; carry it with the check). Fails if the folder would
# exceed 64 MiB (what travels with one call to the lent machine).
#   scripts/gpu_wheels.sh [--python-version 3.12] [--dest .whl]
# --python-version X.Y: wheels for another interpreter (the CPU dry run uses the local one).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=3.12
DEST=.whl
while (( $# )); do
    case "$1" in
        --python-version) PYVER=$2; shift 2 ;;
        --dest) DEST=$2; shift 2 ;;
        *) echo "gpu_wheels: unknown argument $1" >&2; exit 2 ;;
    esac
done
mapfile -t specs < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' scripts/gpu_wheels.txt | grep -v '^$')
rm -rf "$DEST"
mkdir -p "$DEST"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# One pip call per destination ("build/NAME==V" goes into $DEST/build/), the two at once: each
# call costs a start and index round trips (eight calls in a row took ~28 s, these ~15 s).
runtime=() build=()
for spec in "${specs[@]}"; do
    if [[ "$spec" == build/* ]]; then build+=("${spec#build/}"); else runtime+=("$spec"); fi
done
download() {  # download DIR SPEC...
    local dir=$1; shift
    (( $# )) || return 0
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp "${platforms[@]}" -d "$dir" "$@"
}
download "$DEST/build" "${build[@]}" &  # the two at once: they wait on the network
download "$DEST" "${runtime[@]}"
wait $!
count=$(find "$DEST" -type f -name '*.whl' | wc -l)  # runtime + build
if (( count != ${#specs[@]} )); then
    echo "gpu_wheels: expected ${#specs[@]} wheels, got $count in $DEST" >&2
    exit 1
fi
bytes=$(du -sb "$DEST" | cut -f1)
if (( bytes >= 64 * 1024 * 1024 )); then
    echo "gpu_wheels: $DEST holds $bytes bytes, over the 64 MiB a call can carry" >&2
    exit 1
fi
echo "gpu_wheels: $count wheels for cp${PYVER/./}, $(( bytes / 1024 )) KiB in $DEST/"
