#!/usr/bin/env bash
# The wheel folder a GPU node needs for scripts/gpu_acceptance.sh, made where PyPI
# is reachable (a GPU node has no registry). The node's image (docs/GPU.md) has
# CUDA torch, numpy, msgpack, psutil, prometheus-client, pytest, hypothesis and
# transformers 5.17 with its dependencies; it lacks pyzmq, posix-ipc and crc32c, and its
# transformers is older than kvtier[transformers] (>= 5.19). So the folder holds:
#   pyzmq, posix-ipc, crc32c          kvtier's core dependencies the image lacks
#   transformers 5.24.0               the newest kvtier claims (the HF CUDA tests and bench)
#   regex                             transformers 5.24 wants regex >= 2025.10.22
# ~15 MiB in all (the acceptance refuses a folder over 60 MiB). Pinned versions:
# the ones scripts/test.sh tests with.
#
#   bash scripts/gpu_wheels.sh [DIR]      (default .whl/, git-ignored; KVTIER_WHEELS names it too)
#
# Python 3.12 on x86-64 by default (the node's); GPU_PYTHON=3.11 for another.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-${KVTIER_WHEELS:-.whl}}"
PYV="${GPU_PYTHON:-3.12}"
WANT=(pyzmq==27.3.0 posix-ipc==1.3.2 crc32c==2.9.post0 transformers==5.24.0 regex==2026.11.19)
mkdir -p "$DIR"
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d "$DIR" "${WANT[@]}" 2>&1 | grep -v "^WARNING: Location" || true
for want in "${WANT[@]}"; do  # pip's own failure is hidden by the filter above
    name="${want%%==*}"
    ls "$DIR/${name//-/_}-${want##*==}-"*.whl >/dev/null 2>&1 || { echo "gpu_wheels: $want not downloaded" >&2; exit 1; }
done
echo "wheels for Python $PYV in $DIR: $(du -sh "$DIR" | cut -f1)"
