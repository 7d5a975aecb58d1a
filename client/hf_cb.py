#!/usr/bin/env python
"""Two Hugging Face continuous-batching processes sharing a prompt prefix through kvtier.

    kvtier-daemon &                              # or: --start-daemon (a private one)
    python client/hf_cb.py                       # a random tiny Llama (no download)
    python client/hf_cb.py --model Qwen/Qwen2.5-0.5B-Instruct

Engine A (one process) answers a question about a long document; kvtier
stores the document's KV blocks. Engine B (another process, started after A
has exited) asks a different question about the same document: it loads the
document's blocks from kvtier instead of prefilling them. Each engine prints
its time to first token and what kvtier did for it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TEXT = ("kvtier keeps the KV cache blocks that inference engines computed in one shared pool per node, "
        "so that a prompt prefix computed by one process is loaded, not recomputed, by the next. ")


def load(model_name: str | None):
    """(model, document token ids, question token ids, model id for the namespace)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if model_name is None:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
        config._attn_implementation = "sdpa"
        g = torch.Generator().manual_seed(1)
        doc = torch.randint(3, 1024, (1024,), generator=g).tolist()
        questions = [torch.randint(3, 1024, (12,), generator=g).tolist() for _ in range(2)]
        return LlamaForCausalLM(config).eval(), doc, questions, "kvtier-example/random-llama-seed0"
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    model = AutoModelForCausalLM.from_pretrained(model_name, attn_implementation="sdpa").eval()
    doc = tokenizer(TEXT * 40)["input_ids"]
    questions = [tokenizer(f" Question {i}: what does kvtier share?")["input_ids"] for i in range(2)]
    return model, doc, questions, model_name  # the namespace takes the revision from the loaded config


def engine(name: str, which: int, socket: str, model_name: str | None) -> None:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvtier.integrations.transformers import KVTierContinuousBatchingManager

    model, doc, questions, model_id = load(model_name)
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb_config = ContinuousBatchingConfig(page_size=16, num_blocks=(len(doc) + 64) // 16 + 8,
                                         use_cuda_graph=False, use_async_batching=False)
    with KVTierContinuousBatchingManager(model, gen, cb_config, model_id=model_id, socket=socket) as cb:
        out, = cb.generate([doc + questions[which]], record_timestamps=True)
    ttft = (out.timestamps[0] - out.created_time) * 1e3
    c = cb.counters
    print(f"engine {name} (pid {os.getpid()}): prompt {len(out.prompt_ids)} tokens, first token after {ttft:.1f} ms; "
          f"{c.loaded_tokens} prompt tokens loaded from kvtier, {c.computed_tokens} computed, "
          f"{c.stored_blocks} blocks stored; output {out.generated_tokens}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", help="kvtier socket (default: KVTIER_SOCKET or the standard path)")
    ap.add_argument("--start-daemon", action="store_true", help="run a private kvtier-daemon for the example")
    ap.add_argument("--model", help="a Hugging Face model id (default: a random tiny Llama, no download)")
    args = ap.parse_args()
    from kvtier.demo.daemon_proc import PrivateDaemon
    from kvtier.protocol.endpoints import default_socket

    daemon = PrivateDaemon(pool_size="512MiB", slab_size="16MiB") if args.start_daemon else None
    socket = daemon.socket if daemon else args.socket or default_socket()
    try:
        ctx = mp.get_context("spawn")  # fresh interpreters: nothing shared but the daemon
        for name, which in (("A", 0), ("B", 1)):
            proc = ctx.Process(target=engine, args=(name, which, socket, args.model))
            proc.start()
            proc.join()
            if proc.exitcode:
                return proc.exitcode
    finally:
        if daemon is not None:
            daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
