#!/usr/bin/env bash
# GPU acceptance for kvtier in one command, under 8 minutes where SGLang is not installed
# (docs/GPU.md, "Running the acceptance").
#
#   scripts/gpu_acceptance.sh [RESULTS_DIR]   on the GPU node (default results/gpu-acceptance-<host>-<time>/)
#   scripts/gpu_acceptance.sh --dry-run       anywhere: every step's command, the wheel folder,
#                                             the imports and the GPU tests' collection, checked
#
# For a GPU node with CUDA torch (>= 2.4) and no package registry. What kvtier
# needs beyond the node's image comes from a wheel folder made beforehand where
# PyPI is reachable: `bash scripts/gpu_wheels.sh` (.whl/: pyzmq, posix-ipc, crc32c,
# transformers 5.24.0, regex; ~15 MiB). They are installed with pip --target
# into a private folder put first on PYTHONPATH: the node's own environment is
# left as it was. KVTIER_WHEELS names another folder.
#
# Steps, each under a time limit, each writing its log (and a bench's JSON)
# into RESULTS_DIR and folding its outcome into RESULTS_DIR/summary.json the
# moment it ends, so a run cut short keeps every finished step:
#   setup             ~15 s  (limit  60 s) wheels -> private site folder; machine, versions, commit
#   gpu_tests         ~3 min (limit 240 s) ONE pytest pass over every GPU test (-m gpu): layouts x copy
#                                          methods, fences, two processes byte-exact, memory released,
#                                          HF continuous batching on CUDA, the engine adapter on CUDA,
#                                          SGLang engines end to end (test_sglang_engine.py): where the
#                                          node has SGLang 0.5.23 installed, ~2 min more and the limit
#                                          is 480 s; elsewhere (the device tool's machine) it skips
#   bench_gpu         ~1 min (limit  80 s) store/load GB/s next to pinned cudaMemcpy; pinning s/GiB
#   bench_gpu_prefix  ~1 min (limit  80 s) TTFT of a 1,024-token prefix loaded from another process
#                                          vs prefilled (HF, bf16, Llama-3-8B width, 8 layers)
# Worst case, every limit reached: 7 min 40 s (11 min 40 s with SGLang); expected ~5 min (~7).
# At most 8 files land in RESULTS_DIR (what the device tool brings back).
# Exit status: 0 when every step passed.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
WHEELS="${KVTIER_WHEELS:-$REPO/.whl}"
MAX_WHEELS_MIB=60
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
RESULTS="${1:-$REPO/results/gpu-acceptance-$(hostname -s)-$(date -u +%Y%m%dT%H%M%SZ)}"
die() { echo "gpu_acceptance: $*" >&2; exit 2; }

# ---- the steps' commands (the dry run prints and checks these very arrays) -------------
PYTEST_TIMEOUT=()
# pytest-timeout (in the node's image): one hung test fails alone instead of eating the step's limit.
if "$PY" -c "import pytest_timeout" 2>/dev/null; then PYTEST_TIMEOUT=(--timeout 150); fi
GPU_TESTS=("$PY" -m pytest -m gpu -n 0 -p no:cacheprovider -q -rA "${PYTEST_TIMEOUT[@]}" tests)
GPU_TESTS_LIMIT=240
# SGLang's engines (three starts, two of them side by side) run only where SGLang is installed,
# found without importing it; they take ~2 minutes more, their test a limit of its own (240 s).
SGLANG=$("$PY" -c "from importlib.metadata import version; print(version('sglang'))" 2>/dev/null || true)
if [[ -n "$SGLANG" ]]; then GPU_TESTS_LIMIT=480; fi
BENCH_GPU=("$PY" scripts/bench_gpu.py --blocks 128 --iters 5 --pool-size 1GiB --pin-gib 2)
BENCH_PREFIX=("$PY" scripts/bench_gpu_prefix.py --prefix 1024 --layers 8 --questions 3)
# Modules the steps import, beyond the test files themselves.
MODULES=(torch numpy zmq msgpack posix_ipc crc32c psutil prometheus_client pytest hypothesis transformers
         kvtier.client kvtier.daemon.server kvtier.transfer.cuda kvtier.transfer.gpu kvtier.transfer.pinning
         kvtier.integrations.engine_kv kvtier.integrations.transformers kvtier.demo.daemon_proc)

check_wheels() {  # the folder holds what scripts/gpu_wheels.sh makes, and is small enough to carry
    [[ -d "$WHEELS" ]] || { echo "no wheel folder at $WHEELS: run scripts/gpu_wheels.sh" >&2; return 1; }
    local missing=() name
    for name in pyzmq posix_ipc crc32c transformers regex; do
        compgen -G "$WHEELS/$name-*.whl" >/dev/null || missing+=("$name")
    done
    ((${#missing[@]} == 0)) || { echo "wheel folder $WHEELS lacks: ${missing[*]}" >&2; return 1; }
    local kib; kib=$(du -sk "$WHEELS" | cut -f1)
    ls -l "$WHEELS"
    echo "wheel folder: $((kib / 1024)) MiB (limit $MAX_WHEELS_MIB MiB)"
    ((kib <= MAX_WHEELS_MIB * 1024)) || { echo "wheel folder over $MAX_WHEELS_MIB MiB" >&2; return 1; }
}

check_transformers() {  # the version kvtier[transformers] claims, not the image's older one
    "$PY" - <<'EOF'
import transformers
major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
print(f"transformers {transformers.__version__} from {transformers.__file__}")
raise SystemExit(0 if (5, 19) <= (major, minor) <= (5, 24) else
                 f"transformers {transformers.__version__} is outside kvtier[transformers] (5.19-5.24)")
EOF
}

if ((DRY)); then
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
    echo "== dry run: nothing touches a GPU"
    printf '  setup:            pip install --no-index --no-deps --target <private> %s/*.whl\n' "$WHEELS"
    printf '  gpu_tests:        %s  (limit %ss)\n' "${GPU_TESTS[*]}" "$GPU_TESTS_LIMIT"
    echo "  sglang:           ${SGLANG:-not installed: the SGLang engine test will skip}"
    printf '  bench_gpu:        %s --out RESULTS/bench_gpu.json\n' "${BENCH_GPU[*]}"
    printf '  bench_gpu_prefix: %s --out RESULTS/bench_gpu_prefix.json\n' "${BENCH_PREFIX[*]}"
    check_wheels || exit 1
    for mod in "${MODULES[@]}"; do
        "$PY" -c "import $mod" || die "cannot import $mod"
    done
    echo "imports: ${#MODULES[@]} modules OK"
    check_transformers || exit 1
    "$PY" -c "import importlib.util as u, sys
for path in ('scripts/bench_gpu.py', 'scripts/bench_gpu_prefix.py', 'scripts/gpu_summary.py'):
    spec = u.spec_from_file_location(path.rsplit('/', 1)[-1][:-3], path)
    spec.loader.exec_module(u.module_from_spec(spec))
print('bench scripts import OK')" || die "a bench script does not import"
    # Collection must not fail without vLLM, Redis or a GPU (one error used to stop every test).
    out=$("${GPU_TESTS[@]}" --collect-only 2>&1); rc=$?
    echo "$out" | tail -n 3
    [[ $rc -eq 0 ]] || die "collecting the GPU tests failed (exit $rc)"
    n=$(echo "$out" | grep -c '::' || true)
    ((n > 0)) || die "no GPU test collected"
    n_sglang=$(echo "$out" | grep -c 'test_sglang_engine.py::' || true)
    ((n_sglang > 0)) || die "the SGLang engine end-to-end test was not collected"
    echo "dry run OK: $n GPU tests collected ($n_sglang of them SGLang's engine end to end)"
    exit 0
fi

# ---- the run ---------------------------------------------------------------------------
mkdir -p "$RESULTS" || die "cannot create $RESULTS"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvtier-gpu-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
echo "results: $RESULTS"

step() {  # step NAME LIMIT_S COMMAND...: run it under its limit, keep its log, fold it into the summary
    local name="$1" limit="$2"; shift 2
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    local rc
    if declare -F "$1" >/dev/null; then  # a function of this script (setup): the same limit, by a watchdog
        ( "$@" ) >"$RESULTS/$name.log" 2>&1 &
        local pid=$!
        ( sleep "$limit"; pkill -KILL -P "$pid"; kill -KILL "$pid" ) 2>/dev/null &
        local watchdog=$!
        wait "$pid"
        rc=$?
        pkill -P "$watchdog" 2>/dev/null; kill "$watchdog" 2>/dev/null; wait "$watchdog" 2>/dev/null
    else  # timeout signals the command's whole process group: daemons a killed step started go too
        timeout --kill-after=10 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
        rc=$?
    fi
    "$PY" scripts/gpu_summary.py "$RESULTS" "$name" "$rc" "$((SECONDS - start))" "$WORK/$name.xml"
    tail -n 3 "$RESULTS/$name.log"
    echo "   exit $rc after $((SECONDS - start))s"
}

setup() {
    set -e
    "$PY" - <<'EOF'
import sys, torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
print(f"python {sys.version.split()[0]}  torch {torch.__version__}  cuda {torch.version.cuda}  "
      f"devices {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
if (major, minor) < (2, 4) or not torch.cuda.is_available():
    raise SystemExit("needs CUDA torch >= 2.4 and a visible GPU")
EOF
    check_wheels
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" "$WHEELS"/*.whl
    check_transformers
    # The compiled index (kvtier/pool/_native.c) where the node has a C compiler; else the pure-Python one runs.
    "$PY" setup.py -q build_ext --inplace >"$WORK/build_ext.log" 2>&1 || echo "no compiled index: the pure-Python one runs"
    for mod in "${MODULES[@]}"; do "$PY" -c "import $mod"; done
    "$PY" - "$RESULTS/setup.json" <<'EOF'
import json, subprocess, sys, time, torch, transformers, zmq
def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""
doc = {"when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
       "kvtier_commit": run("git", "rev-parse", "HEAD"), "device": torch.cuda.get_device_name(0),
       "devices": run("nvidia-smi", "-L"), "driver": run("nvidia-smi", "--query-gpu=driver_version",
                                                          "--format=csv,noheader"),
       "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
       "transformers": transformers.__version__, "pyzmq": zmq.__version__,
       "sglang": run(sys.executable, "-c", "from importlib.metadata import version; print(version('sglang'))")
                 or None}
json.dump(doc, open(sys.argv[1], "w"), indent=2)
print(json.dumps(doc))
EOF
}

export PYTHONPATH="$WORK/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
step setup 60 setup
if ! "$PY" -c "import json,sys; sys.exit(not json.load(open('$RESULTS/summary.json'))['steps']['setup']['passed'])"; then
    echo "setup failed: see $RESULTS/setup.log" >&2
    exit 1
fi
step gpu_tests "$GPU_TESTS_LIMIT" "${GPU_TESTS[@]}" --junitxml="$WORK/gpu_tests.xml"
step bench_gpu 80 "${BENCH_GPU[@]}" --out "$RESULTS/bench_gpu.json"
step bench_gpu_prefix 80 "${BENCH_PREFIX[@]}" --out "$RESULTS/bench_gpu_prefix.json"

"$PY" - "$RESULTS/summary.json" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
for name, s in doc["steps"].items():
    extra = f"  {s['counts']}" if "counts" in s else ""
    print(f"{name:<18} {'passed' if s['passed'] else 'FAILED'}  {s['seconds']:>4}s{extra}")
    for check, outcome in s.get("checks", {}).items():
        why = s.get("checks_skipped_because", {}).get(check)
        print(f"  {check:<30} {outcome}{f': {why}' if why else ''}")
    for test, outcome in s.get("not_passed", {}).items():
        print(f"  {outcome}: {test}")
print(f"summary: {sys.argv[1]}  ({'all passed' if doc['passed'] else 'FAILED'})")
sys.exit(0 if doc["passed"] else 1)
EOF
