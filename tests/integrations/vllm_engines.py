"""Long-lived real vLLM engines for tests: ``scripts/vllm_engine.py`` driven over stdin/stdout.

An engine start costs 15-60 s here, so a test module starts each engine once
and sends it several requests in turn. ``LiveEngine(name, model, tmp, tp=..,
socket=..)`` starts one (a TP=2 engine binds its ranks' OpenMP threads to
cores 0 and 1); ``wait_ready``, ``generate``, ``metrics``, ``quit``, ``close``.
``make_tiny_mla`` writes a random DeepSeek-V2-style MLA checkpoint (latent
512 + rope 64), which vLLM's CPU build runs. ``busy_neighbours()``: one
spinning process per core while the block runs (CPU contention).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

from tests.conftest import REPO

ENGINE = os.path.join(REPO, "scripts", "vllm_engine.py")


def make_tiny_mla(path: str, layers: int = 2, seed: int = 0) -> str:
    """A random DeepSeek-V2 (MLA: kv_lora_rank 512, rope 64; dense MLPs only)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    torch.manual_seed(seed)
    cfg = DeepseekV2Config(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                           num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                           kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
                           v_head_dim=128, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                           first_k_dense_replace=layers, topk_method="greedy", max_position_embeddings=4096,
                           torch_dtype="bfloat16")
    DeepseekV2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


@contextlib.contextmanager
def busy_neighbours(count: int | None = None):
    """A neighbour that keeps every core busy (one spinning process per core)
    while the block runs: the engine's ranks, the daemon and the scheduler
    get their time slices late, as on a loaded node."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(count or os.cpu_count() or 1)]
    try:
        yield spinners
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()


class LiveEngine:
    def __init__(self, name: str, model: str, log_dir, *, tp: int = 1, socket: str | None = None,
                 block_size: int = 32, max_model_len: int = 2048, extra: tuple[str, ...] = ()):
        self.name = name
        binds = "|".join(str(r % max(1, os.cpu_count() or 1)) for r in range(tp))  # one core per rank
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": binds,
               "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
               # The engine core runs in the engine's process (a TP=2 engine still starts a
               # worker per rank): one vLLM import fewer, ~45 s of CPU an engine here.
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, ENGINE, "--model", model, "--tp", str(tp), "--block-size", str(block_size),
               "--max-model-len", str(max_model_len), "--max-num-seqs", "4"]
        if socket:
            cmd += ["--kvtier", "--socket", socket]
        cmd += list(extra)
        self.log = os.path.join(str(log_dir), f"{name}.log")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log, "w"), text=True, env=env)

    def wait_ready(self) -> dict:
        return self._read("READY ")

    def _read(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return json.loads(line[len(tag):])
        raise RuntimeError(f"engine {self.name} exited; its log:\n" + open(self.log).read()[-4000:])

    def call(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read("RESULT ")

    def generate(self, prompts: list, max_tokens: int = 8, fresh: bool = False) -> list:
        """Greedy tokens; ``fresh``: vLLM reads no cached prefix (computes all itself)."""
        return self.call("generate", prompts=prompts, max_tokens=max_tokens, fresh=fresh)["tokens"]

    def metrics(self) -> dict:
        return self.call("metrics")

    def quit(self) -> None:
        """Ask the engine to exit (``close`` waits for it): engines shut down side by side."""
        if self.proc.poll() is None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.close()
            except OSError:
                pass

    def close(self) -> None:
        self.quit()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
