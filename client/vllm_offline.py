"""Two vLLM engine processes share a prompt prefix through kvtier (offline, CPU or GPU).

    kvtier-daemon &                          # or: --start-daemon (a private one)
    python client/vllm_offline.py            # a tiny random Llama, made on the spot
    python client/vllm_offline.py --model meta-llama/Llama-3.2-1B --prefix-tokens 4000

Engine A answers prompts that share a long prefix and offloads its blocks to
kvtier; engine B, a new process, gets the same prompts, loads the prefix
from kvtier instead of prefilling it, and must produce the same tokens.

``engine`` runs one engine and prints one JSON line; the tests and
``scripts/bench_vllm.py`` drive it too:

    python client/vllm_offline.py engine --model DIR --prompts FILE [--no-kvtier] ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


SPEC = "kvtier.integrations.vllm:KVTierOffloadingSpec"


def kv_transfer_config(socket: str | None, block_size: int = 32, kvtier_events: str = "", spec: str = SPEC,
                       kv_role: str = "kv_both") -> dict:
    """The one setting that puts a vLLM engine on kvtier (``spec``: MODULE:CLASS, a test's subclass;
    ``kv_role``: kv_both, or kv_producer (stores, never loads) / kv_consumer (loads, never stores))."""
    module, _, name = spec.partition(":")
    extra = {"spec_name": name, "spec_module_path": module, "block_size": block_size}
    if socket:
        extra["kvtier_socket"] = socket
    if kvtier_events:
        extra["kvtier_events"] = kvtier_events
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": kv_role, "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def make_tiny_llama(path: str, layers: int = 2, hidden: int = 128, seed: int = 0) -> str:
    """A random Llama saved like a checkpoint (no download, no tokenizer).
    Head size 64: vLLM's CPU attention supports only some head sizes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=max(1, hidden // 128), head_dim=64, max_position_embeddings=8192, torch_dtype="bfloat16")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def shared_prefix_prompts(prefix_tokens: int, n: int, suffix_tokens: int = 24, vocab: int = 500,
                          seed: int = 1234) -> list:
    import random
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab) for _ in range(prefix_tokens)]
    return [prefix + [rng.randrange(1, vocab) for _ in range(suffix_tokens)] for _ in range(n)]


# ---- one engine --------------------------------------------------------------------------
def run_engine(args) -> dict:
    from vllm import LLM, SamplingParams
    prompts = json.load(open(args.prompts))
    kw = {}
    if not args.no_kvtier:
        from vllm.config import KVTransferConfig
        kw["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config(args.socket, args.block_size,
                                                                         args.kvtier_events, args.kvtier_spec,
                                                                         args.kv_role))
    if args.kv_events:  # vLLM's KV event stream (what routers read), published on ZeroMQ
        from vllm.config import KVEventsConfig
        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                endpoint=args.kv_events, topic="kvtier")
    if args.in_process:  # scheduler and worker in this process: no process starts (tests run several engines)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kw["distributed_executor_backend"] = "uni"
    t0 = time.perf_counter()
    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype=args.dtype,
              block_size=args.block_size, max_model_len=args.max_model_len, seed=0,
              max_num_seqs=4, disable_log_stats=False,
              gpu_memory_utilization=args.mem_util, **kw)
    start_s = time.perf_counter() - t0
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, detokenize=False)
    first = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    tokens, ttft = [], []
    for i, p in enumerate(prompts):
        if i == args.pause_after and args.sync_dir:
            _pause(args.sync_dir)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p}], first, use_tqdm=False)  # time to first token
        ttft.append(time.perf_counter() - t)
        if args.max_tokens > 1:
            out = llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)
            tokens.append(list(out[0].outputs[0].token_ids))
    metrics = {}
    for m in llm.get_metrics():
        if any(s in m.name for s in ("prefix_cache", "kv_offload", "external", "prompt_tokens")):
            value = getattr(m, "value", None)
            if isinstance(value, (int, float)):
                metrics[m.name] = metrics.get(m.name, 0) + value
    if args.in_process:
        llm.llm_engine.engine_core.shutdown()  # the connector's clients let go before the next engine
    return {"tokens": tokens, "ttft_s": ttft, "start_s": start_s, "metrics": metrics}


def _pause(sync_dir: str) -> None:
    """Tell the driver we are between prompts; go on when it says so (a readiness
    handshake, so it can kill the daemon at a known point)."""
    open(os.path.join(sync_dir, "paused"), "w").close()
    while not os.path.exists(os.path.join(sync_dir, "resume")):
        time.sleep(0.05)


def engine_command(model: str, prompts_file: str, *, socket: str | None, kvtier: bool = True,
                   dtype: str = "bfloat16", max_tokens: int = 8, block_size: int = 32,
                   max_model_len: int = 4096, pause_after: int = -1, sync_dir: str = "",
                   kv_events: str = "", kvtier_events: str = "", kvtier_spec: str = SPEC,
                   kv_role: str = "kv_both") -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "engine", "--model", model, "--prompts", prompts_file,
           "--dtype", dtype, "--max-tokens", str(max_tokens), "--block-size", str(block_size),
           "--max-model-len", str(max_model_len), "--pause-after", str(pause_after)]
    if socket:
        cmd += ["--socket", socket]
    if not kvtier:
        cmd.append("--no-kvtier")
    if sync_dir:
        cmd += ["--sync-dir", sync_dir]
    if kv_events:
        cmd += ["--kv-events", kv_events]
    if kvtier_events:
        cmd += ["--kvtier-events", kvtier_events]
    if kvtier_spec != SPEC:
        cmd += ["--kvtier-spec", kvtier_spec]
    if kv_role != "kv_both":
        cmd += ["--kv-role", kv_role]
    return cmd


def engine_env(**extra) -> dict:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def parse_result(stdout: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith("KVTIER_RESULT "):
            return json.loads(line[len("KVTIER_RESULT "):])
    raise RuntimeError("the engine printed no result")


def run_engine_process(cmd: list[str], timeout: float = 600) -> dict:
    p = subprocess.run(cmd, capture_output=True, text=True, env=engine_env(), timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"engine exited {p.returncode}:\n{p.stderr[-4000:]}")
    return parse_result(p.stdout)


# ---- the example -------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    e = sub.add_parser("engine", help="run one engine over a prompts file, print one JSON line")
    e.add_argument("--model", required=True)
    e.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    e.add_argument("--socket", default=None)
    e.add_argument("--no-kvtier", action="store_true")
    e.add_argument("--dtype", default="bfloat16")
    e.add_argument("--max-tokens", type=int, default=8)
    e.add_argument("--block-size", type=int, default=32)
    e.add_argument("--max-model-len", type=int, default=4096)
    e.add_argument("--pause-after", type=int, default=-1)
    e.add_argument("--sync-dir", default="")
    e.add_argument("--kv-events", default="", help="publish vLLM's KV events on this ZeroMQ endpoint")
    e.add_argument("--kvtier-events", default="", help="the daemon's block event endpoint (its `events`)")
    e.add_argument("--mem-util", type=float, default=0.3, help="vLLM CPU: fraction of RAM it may reserve")
    e.add_argument("--kvtier-spec", default=SPEC, help="the offloading spec, MODULE:CLASS")
    e.add_argument("--in-process", action="store_true", help="no engine-core or worker process (CPU)")
    e.add_argument("--kv-role", default="kv_both", choices=("kv_both", "kv_producer", "kv_consumer"))
    ap.add_argument("--model", default=None, help="checkpoint dir or id (default: a tiny random Llama)")
    ap.add_argument("--socket", default=None, help="kvtier socket (default: KVTIER_SOCKET or the standard path)")
    ap.add_argument("--start-daemon", action="store_true", help="run a private kvtier-daemon for the example")
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=4)
    args = ap.parse_args(argv)
    if args.cmd == "engine":
        print("KVTIER_RESULT " + json.dumps(run_engine(args)), flush=True)
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_tiny_llama(os.path.join(tmp, "tiny-llama"))
        prompts_file = os.path.join(tmp, "prompts.json")
        json.dump(shared_prefix_prompts(args.prefix_tokens, args.prompts), open(prompts_file, "w"))
        daemon, socket = None, args.socket
        if args.start_daemon:
            socket = os.path.join(tmp, "kvtier.sock")
            daemon = subprocess.Popen([sys.executable, "-m", "kvtier.daemon", "--socket", socket,
                                       "--pool-size", "1GiB"], env=engine_env())
            while not os.path.exists(socket):
                if daemon.poll() is not None:
                    raise SystemExit("kvtier-daemon did not start")
                time.sleep(0.05)
        try:
            a = run_engine_process(engine_command(model, prompts_file, socket=socket))
            b = run_engine_process(engine_command(model, prompts_file, socket=socket))
        finally:
            if daemon is not None:
                daemon.terminate()
                daemon.wait(30)
    same = a["tokens"] == b["tokens"]
    print(f"engine A first-prompt TTFT {a['ttft_s'][0] * 1e3:.1f} ms (prefilled the prefix, stored it)")
    print(f"engine B first-prompt TTFT {b['ttft_s'][0] * 1e3:.1f} ms (loaded it from kvtier)")
    print(f"engine B external prefix-cache hits: {b['metrics']}")
    print(f"tokens identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
