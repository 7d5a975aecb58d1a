"""One long-lived vLLM (CPU build) engine, driven line by line over stdin/stdout.

    python scripts/vllm_engine.py --model DIR [--kvtier --socket PATH] [--block-size 32] ...

``scripts/bench_vllm.py`` starts several of these side by side (vLLM alone,
vLLM with kvtier) so every engine is started, warmed and alive for the whole
run, and the prompts can go to them interleaved. The engine prints one
``READY {json}`` line with its resolved settings (what vLLM's engine core and
worker actually run with: scheduler, cache, threads and their CPU binding, the
KV cache's memory mapping), then answers each command line with one ``RESULT {json}`` line (vLLM may
print other lines to stdout too):

* ``{"op": "ttft", "prompt": [ids]}`` -> ``{"s": seconds}`` (a 1-token generate)
* ``{"op": "generate", "prompts": [[ids]], "max_tokens": n}`` -> ``{"s": .., "tokens": [[ids]]}``;
  with ``"fresh": true`` vLLM reads no cached prefix (neither its own nor an
  offloaded one): it computes every token itself, and still stores
* ``{"op": "reset"}`` -> vLLM's own prefix cache dropped (the next request of a
  stored prompt can only hit kvtier)
* ``{"op": "adopt_kv"}`` -> the KV cache moved into a memfd as kvtier's worker does
  (with no connector: the memory-placement A/B)
* ``{"op": "touch_kv"}`` -> every page of the KV cache written once (vLLM alone
  and kvtier then both run on memory that was touched before timing)
* ``{"op": "settings"}`` -> the resolved settings again (e.g. after a warmup)
* ``{"op": "metrics"}`` -> vLLM's prefix-cache / offload counters
* ``{"op": "quit"}``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "client"))
sys.path.insert(0, REPO)


def _worker_facts(worker) -> dict:
    """Runs inside vLLM's worker (engine-core process): what its compute really uses."""
    import torch
    import vllm
    vc = worker.vllm_config
    sc, cc, pc = vc.scheduler_config, vc.cache_config, vc.parallel_config
    facts = {
        "scheduler": {k: getattr(sc, k, None) for k in (
            "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill", "long_prefill_token_threshold",
            "max_num_partial_prefills", "async_scheduling", "scheduler_cls", "policy",
            "disable_hybrid_kv_cache_manager", "disable_chunked_mm_input")},
        "cache": {k: getattr(cc, k, None) for k in (
            "block_size", "cache_dtype", "num_gpu_blocks", "num_cpu_blocks", "enable_prefix_caching",
            "prefix_caching_hash_algo", "kv_cache_memory_bytes", "cpu_kvcache_space_bytes", "swap_space")},
        "compilation_mode": str(getattr(vc.compilation_config, "mode", None)),
        "cudagraph_mode": str(getattr(vc.compilation_config, "cudagraph_mode", None)),
        "parallel": {"tp": pc.tensor_parallel_size, "pp": pc.pipeline_parallel_size,
                     "executor": str(pc.distributed_executor_backend)},
        "model_dtype": str(vc.model_config.dtype), "max_model_len": vc.model_config.max_model_len,
        "enforce_eager": vc.model_config.enforce_eager,
        "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
        "process_affinity": sorted(os.sched_getaffinity(0)),
        "pids": {"worker": os.getpid(), "engine_core": os.getppid()},
        # which vLLM the worker imported: 0.33's sources over 0.32's CPU kernels say 0.33.0 here
        "vllm": vllm.__version__,
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("OMP_", "KMP_", "GOMP_", "VLLM_CPU", "MKL_", "LD_PRELOAD", "MALLOC", "THP_"))},
    }
    runner = worker.model_runner
    facts["attention_backend"] = sorted({type(g.backend).__name__ if not isinstance(g.backend, type)
                                         else g.backend.__name__
                                         for groups in getattr(runner, "attn_groups", []) for g in groups})
    kv = [t for t in _kv_tensors(runner)]
    if kv:
        lo = min(t.untyped_storage().data_ptr() for t in kv)
        hi = max(t.untyped_storage().data_ptr() + t.untyped_storage().nbytes() for t in kv)
        facts["kv_cache"] = {"tensors": len(kv), "bytes": hi - lo, "shape0": list(kv[0].shape),
                             "stride0": list(kv[0].stride()), "dtype": str(kv[0].dtype),
                             "mapping": _mapping(lo, hi)}
    return facts


def _kv_tensors(runner) -> list:
    seen, out = set(), []
    for t in getattr(runner, "kv_caches", []) or []:
        for x in (t if isinstance(t, (list, tuple)) else [t]):
            if hasattr(x, "data_ptr") and x.untyped_storage().data_ptr() not in seen:
                seen.add(x.untyped_storage().data_ptr())
                out.append(x)
    return out


def _mapping(lo: int, hi: int) -> dict:
    """What /proc/self/smaps says about the memory under [lo, hi): which mapping
    (anonymous or a memfd), resident and huge-page kilobytes, VmFlags."""
    out = {"areas": 0, "names": set(), "kB": {}, "flags": set()}
    cur = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                a, b = (int(x, 16) for x in head[0].split("-"))
                cur = a < hi and b > lo
                if cur:
                    out["areas"] += 1
                    out["names"].add(head[5] if len(head) > 5 else "[anon]")
            elif cur and head[0] == "VmFlags:":
                out["flags"].update(head[1:])
            elif cur and head[0].endswith(":") and len(head) == 3 and head[2] == "kB":
                k = head[0][:-1]
                if k in ("Rss", "Anonymous", "Shared_Clean", "Shared_Dirty", "Private_Dirty", "AnonHugePages",
                         "ShmemPmdMapped", "FilePmdMapped", "Swap"):
                    out["kB"][k] = out["kB"].get(k, 0) + int(head[1])
    out["names"] = sorted(n.split(".a")[0] if "kvtier" in n else n for n in out["names"])
    out["flags"] = sorted(out["flags"])
    return out


def _touch_kv(worker) -> int:
    """Write every byte of the KV cache once (zeros, as vLLM's own allocation did)."""
    n = 0
    for t in _kv_tensors(worker.model_runner):
        t.untyped_storage().fill_(0) if hasattr(t.untyped_storage(), "fill_") else t.zero_()
        n += t.untyped_storage().nbytes()
    return n


def _adopt_kv(worker) -> str:
    """Move this engine's KV cache into a sealed memfd the way kvtier's worker does
    (no connector, no daemon): vLLM alone with kvtier's memory placement."""
    from kvtier.transfer.adopt import adopt_tensors
    global _ADOPTED
    _ADOPTED = adopt_tensors(_kv_tensors(worker.model_runner))
    return _mapping(*_span(worker.model_runner))["names"][0]


_ADOPTED = None


def _span(runner) -> tuple[int, int]:
    kv = _kv_tensors(runner)
    return (min(t.untyped_storage().data_ptr() for t in kv),
            max(t.untyped_storage().data_ptr() + t.untyped_storage().nbytes() for t in kv))


def _threads(_worker) -> list:
    """Every thread of the engine-core process: name, CPU binding, CPU seconds."""
    out = []
    tick = os.sysconf("SC_CLK_TCK")
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        try:
            stat = open(f"/proc/self/task/{tid}/stat").read()
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            fields = stat[stat.rindex(")") + 2:].split()
            cpu_s = (int(fields[11]) + int(fields[12])) / tick
            out.append([name, sorted(os.sched_getaffinity(int(tid))), round(cpu_s, 2)])
        except (OSError, ValueError):
            continue
    return out


def build(args):
    from vllm import LLM
    kw = {}
    if args.kvtier:
        import vllm_offline
        from vllm.config import KVTransferConfig
        transfer = vllm_offline.kv_transfer_config(args.socket, args.block_size)
        if args.tp_layout:
            transfer["kv_connector_extra_config"]["kvtier_tp_layout"] = args.tp_layout
        kw["kv_transfer_config"] = KVTransferConfig(**transfer)
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.tp > 1:  # one worker process per rank (vLLM's CPU build: bind each with VLLM_CPU_OMP_THREADS_BIND="0|1")
        kw["tensor_parallel_size"] = args.tp
    return LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype=args.dtype,
               block_size=args.block_size, max_model_len=args.max_model_len, seed=0, max_num_seqs=args.max_num_seqs,
               disable_log_stats=False, gpu_memory_utilization=args.mem_util, **kw)


def settings(llm) -> dict:
    facts = llm.collective_rpc(_worker_facts)[0]
    facts["threads"] = llm.collective_rpc(_threads)[0]
    return facts


def ttft(llm, cmd: dict) -> dict:
    from vllm import SamplingParams
    first = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": cmd["prompt"]}], first, use_tqdm=False)
    return {"s": time.perf_counter() - t}


def generate(llm, cmd: dict) -> dict:
    from vllm import SamplingParams
    sp = SamplingParams(max_tokens=cmd["max_tokens"], min_tokens=cmd["max_tokens"], temperature=0.0,
                        detokenize=False, ignore_eos=True, skip_reading_prefix_cache=bool(cmd.get("fresh")) or None)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], sp, use_tqdm=False)
    return {"s": time.perf_counter() - t, "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def metrics(llm, cmd: dict | None = None) -> dict:
    res = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)) and any(
                s in m.name for s in ("prefix_cache", "kv_offload", "external", "prompt_tokens")):
            res[m.name] = res.get(m.name, 0) + value
    return res


OPS = {"ttft": ttft, "generate": generate, "reset": lambda llm, cmd: {"ok": bool(llm.reset_prefix_cache())},
       "metrics": metrics}


def answer(llm, start_s: float, ops: dict | None = None) -> None:
    """The command loop of this script and ``peers_engine.py``: ``READY {json}``, then one
    ``RESULT {json}`` per command line until ``quit``; ``OPS`` and ``ops`` (op -> fn(llm, cmd))."""
    ops = {**OPS, **(ops or {})}
    out = sys.stdout
    out.write("READY " + json.dumps({"start_s": start_s, "pid": os.getpid(), "settings": settings(llm)},
                                    default=str) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "quit":
            break
        res = ops[op](llm, cmd) if op in ops else {"error": f"unknown op {op!r}"}
        out.write("RESULT " + json.dumps(res, default=str) + "\n")
        out.flush()


def serve(args) -> None:
    t0 = time.perf_counter()
    llm = build(args)
    answer(llm, time.perf_counter() - t0, {
        "adopt_kv": lambda llm, cmd: {"mapping": llm.collective_rpc(_adopt_kv)[0]},
        "touch_kv": lambda llm, cmd: {"bytes": llm.collective_rpc(_touch_kv)[0]},
        "settings": lambda llm, cmd: settings(llm),
        "threads": lambda llm, cmd: llm.collective_rpc(_threads)[0]})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--kvtier", action="store_true", help="configure kvtier's connector")
    ap.add_argument("--socket", default=None, help="kvtier socket (a path with no daemon: the degraded mode)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: vLLM's default")
    ap.add_argument("--mem-util", type=float, default=0.3)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (worker processes)")
    ap.add_argument("--tp-layout", default="", help="kvtier_tp_layout: shared (kvtier's default) or per-rank")
    serve(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
