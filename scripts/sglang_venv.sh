#!/usr/bin/env bash
# .venv-sglang: SGLang 0.5.23's Python code on CPU torch, for tests/integrations/test_sglang.py
# (scripts/test.sh, so CI, makes it and runs that file in it).
#   bash scripts/sglang_venv.sh && .venv-sglang/bin/python -m pytest -q -n 0 tests/integrations/test_sglang.py
# Every package goes in with --no-deps: SGLang pins torch 2.14.1 and pulls torchvision, either of
# which brings a CUDA torch and the NVIDIA wheels; its host pools and storage backends run on 2.13 CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv-sglang
if [ -x "$V/bin/python" ] && "$V/bin/python" -c "import sglang.srt.mem_cache.hicache_storage" 2>/dev/null; then
    exit 0
fi
python3 -m venv "$V"
"$V/bin/pip" install -q torch==2.13.0                       # the CPU wheel, first
"$V/bin/pip" install -q --no-deps sglang==0.5.23
"$V/bin/pip" install -q -e ".[test]"
"$V/bin/pip" install -q transformers==5.19.0                # its own deps; none of them is torch
"$V/bin/pip" install -q --no-deps orjson pybase64 requests urllib3 idna certifi triton pillow starlette anyio \
    msgspec pydantic_core pydantic typing_inspection tqdm ipython traitlets aiohttp multidict attrs yarl propcache \
    aiohappyeyeballs aiosignal frozenlist dill apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed_tensors \
    loguru gguf
"$V/bin/python" -c "import sglang.srt.mem_cache.hicache_storage"
