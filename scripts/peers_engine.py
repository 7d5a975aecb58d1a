"""One long-lived vLLM (CPU build) engine for ``scripts/bench_peers.py``, any KV connector.

    python scripts/peers_engine.py --model DIR --kv-bytes N [--transfer JSON]

Like ``scripts/vllm_engine.py`` (whose settings probe it reuses), but the KV
connector is whatever ``--transfer`` says (a ``KVTransferConfig`` as JSON:
kvtier's, LMCache's, vLLM's own offloading), so every system of the
comparison starts from the same code with the same arguments. It prints one
``READY {json}`` line (start time, pids, resolved settings) or, when vLLM
cannot build the engine, one ``FAILED {json}`` line with the exception (how
the benchmark learns why a peer does not run here); then answers each command
line with one ``RESULT {json}`` line:

* ``{"op": "ttft", "prompt": [ids]}`` -> ``{"s": seconds}`` (a 1-token generate)
* ``{"op": "generate", "prompts": [[ids]], "max_tokens": n}`` -> ``{"s": .., "tokens": [[ids]]}``
* ``{"op": "reset"}`` -> vLLM's own prefix cache dropped
* ``{"op": "metrics"}`` -> vLLM's prefix-cache / connector counters
* ``{"op": "quit"}``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "client"))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def build(args):
    from vllm import LLM
    kw = {}
    if args.transfer:
        from vllm.config import KVTransferConfig
        kw["kv_transfer_config"] = KVTransferConfig(**json.loads(args.transfer))
    # The KV cache's size in bytes, the same for every system (VLLM_CPU_KVCACHE_SPACE
    # takes whole GiB only and would override this: the caller leaves it unset).
    return LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
               block_size=args.block_size, max_model_len=args.max_model_len, seed=0, max_num_seqs=args.max_num_seqs,
               disable_log_stats=False, kv_cache_memory_bytes=args.kv_bytes,
               disable_hybrid_kv_cache_manager=True, **kw)


def serve(args) -> None:
    import vllm_engine
    t0 = time.perf_counter()
    try:
        llm = build(args)
    except BaseException as e:  # noqa: BLE001 - the driver wants the reason, whatever it is
        sys.stdout.write("FAILED " + json.dumps({"error": f"{type(e).__name__}: {e}",
                                                 "trace": traceback.format_exc()[-4000:]}) + "\n")
        sys.stdout.flush()
        raise SystemExit(3) from None
    vllm_engine.answer(llm, time.perf_counter() - t0)  # the same commands as vllm_engine.py's


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--transfer", default="", help="KVTransferConfig as JSON (empty: no connector)")
    ap.add_argument("--kv-bytes", type=int, required=True, help="vLLM's own KV cache, bytes")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    serve(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
