#!/usr/bin/env bash
# GPU acceptance for kvtier in one command (docs/GPU.md, "Running the acceptance").
#
# For a GPU node that has CUDA torch (>= 2.4) and transformers but no package
# registry. kvtier's remaining dependencies come from a folder of wheels made
# elsewhere for the GPU node's Python (3.12 here; match `python3 -V` there):
#
#   pip download --python-version 3.12 --platform manylinux2014_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#       --only-binary=:all: -d wheels \
#       pyzmq msgpack posix-ipc psutil prometheus-client pytest hypothesis pytest-xdist
#
# Copy `wheels/` next to the checkout (or point KVTIER_WHEELS at it), then:
#
#   scripts/gpu_acceptance.sh [results-file]
#
# It installs only the missing modules from the wheels (never torch or
# transformers), then runs, each as its own step with its output kept:
#   1. pytest -m gpu: every GPU test in the suite
#   2. two engine processes on one GPU sharing a prefix through the daemon, byte-exact
#   3. HF continuous batching on CUDA, tiny random Llama: tokens == model.generate,
#      swap under cache pressure, a cross-process prefix hit
#   4. the engine adapter (EngineKV) driven with CUDA tensors as the vLLM worker drives it:
#      stores fenced, loads awaited, preemption, shutdown, a refused cache
#   5. fences: a hung or killed worker never stalls another client's copies
#   6. scripts/bench_gpu.py: store/load GB/s for 2 MiB blocks and the per-layer layout
#      (32 x 64 KiB) next to pinned cudaMemcpy of the same bytes; pinning s/GiB
#   7. scripts/bench_gpu_prefix.py: TTFT of a 2,048-token prefix loaded from another
#      process vs prefilled (HF, Llama-3-8B-shaped random model, bfloat16)
# and writes one results file (JSON; default results/gpu-acceptance-<host>-<time>.json).
# Exit status: 0 when every step passed.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
WHEELS="${KVTIER_WHEELS:-$REPO/wheels}"
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
OUT="${1:-$REPO/results/gpu-acceptance-$(hostname -s)-$STAMP.json}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvtier-gpu-XXXXXX")"
mkdir -p "$(dirname "$OUT")"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

die() { echo "gpu_acceptance: $*" >&2; exit 2; }

# ---- 0. the machine ----------------------------------------------------------------------
"$PY" - <<'EOF' || die "needs CUDA torch >= 2.4 and a visible GPU"
import sys, torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
ok = (major, minor) >= (2, 4) and torch.cuda.is_available()
print(f"python {sys.version.split()[0]}  torch {torch.__version__}  cuda {torch.version.cuda}  "
      f"devices {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
sys.exit(0 if ok else 1)
EOF
"$PY" -c "import transformers" 2>/dev/null || die "needs transformers (HF step)"

# ---- 1. kvtier's remaining dependencies, from the wheels only ------------------------------
missing=()
for pair in zmq:pyzmq msgpack:msgpack posix_ipc:posix-ipc psutil:psutil prometheus_client:prometheus-client \
            pytest:pytest hypothesis:hypothesis xdist:pytest-xdist; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair##*:}")
done
if ((${#missing[@]})); then
    [[ -d "$WHEELS" ]] || die "missing ${missing[*]} and no wheel folder at $WHEELS (see the top of this script)"
    echo "installing from $WHEELS: ${missing[*]}"
    "$PY" -m pip install --no-index --find-links "$WHEELS" "${missing[@]}" || die "pip install from $WHEELS failed"
fi

# ---- 2. the steps ------------------------------------------------------------------------
STEPS=()
step() {  # step NAME COMMAND...: run it, keep its output and status
    local name="$1"; shift
    echo "== $name: $*"
    local start=$SECONDS
    "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    echo "$rc $((SECONDS - start))" >"$WORK/$name.rc"
    tail -n 3 "$WORK/$name.log"
    STEPS+=("$name")
}
PYTEST=("$PY" -m pytest -n 0 -p no:cacheprovider -q -rA)

step gpu_tests "${PYTEST[@]}" -m gpu tests
step two_engines_byte_exact "${PYTEST[@]}" -m gpu \
    "tests/transfer/test_cuda.py::test_two_worker_processes_share_blocks_byte_exactly"
step hf_continuous_batching_cuda "${PYTEST[@]}" -m gpu tests/integrations/test_transformers_cuda.py
step engine_adapter_cuda "${PYTEST[@]}" -m gpu tests/integrations/test_engine_kv.py
step fences "${PYTEST[@]}" -m gpu tests/transfer/test_cuda_fences.py
step bench_gpu "$PY" scripts/bench_gpu.py --out "$WORK/bench_gpu.json"
step bench_gpu_prefix "$PY" scripts/bench_gpu_prefix.py --out "$WORK/bench_gpu_prefix.json"

# ---- 3. one results file -------------------------------------------------------------------
"$PY" - "$OUT" "$WORK" "${STEPS[@]}" <<'EOF'
import json, os, subprocess, sys, time
import torch
out, work, steps = sys.argv[1], sys.argv[2], sys.argv[3:]
def read(path, limit=20000):
    try:
        with open(path) as f:
            return f.read()[-limit:]
    except OSError:
        return ""
try:
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout.strip()
except (OSError, subprocess.TimeoutExpired):
    smi = ""
try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    commit = ""
doc = {"when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "kvtier_commit": commit,
       "device": torch.cuda.get_device_name(0), "devices": smi, "torch": torch.__version__,
       "cuda": torch.version.cuda, "python": sys.version.split()[0], "steps": {}}
for name in steps:
    rc, seconds = read(os.path.join(work, f"{name}.rc")).split()
    doc["steps"][name] = {"passed": rc == "0", "exit": int(rc), "seconds": int(seconds),
                          "output_tail": read(os.path.join(work, f"{name}.log"))}
for bench in ("bench_gpu", "bench_gpu_prefix"):
    text = read(os.path.join(work, f"{bench}.json"), limit=10**7)
    doc[bench] = json.loads(text) if text else None
doc["passed"] = all(s["passed"] for s in doc["steps"].values())
with open(out, "w") as f:
    json.dump(doc, f, indent=2)
print(f"results: {out}  ({'all passed' if doc['passed'] else 'FAILED: ' + ', '.join(k for k, s in doc['steps'].items() if not s['passed'])})")
sys.exit(0 if doc["passed"] else 1)
EOF
rc=$?
rm -rf "$WORK"
exit $rc
