"""A tiny paged-KV transformer engine with a kvtier prefix cache.

Pure torch, float32, random weights from a fixed seed (no downloads). The KV
cache is one FlashInfer-layout tensor per layer, ``(num_blocks, 2,
block_size, heads, head_dim)``, allocated in shared memory (``ShmKVCache``)
so the daemon can copy blocks in and out by name. Each request gets a block
table from a small free list; blocks are returned (and reused by the next
request) when it finishes.

Exactness: prefill runs in chunks of one block, aligned to absolute block
boundaries, and decode one token at a time. Every matmul therefore has the
same shape whether a block's KV was computed here or loaded from kvtier, so
outputs are bitwise identical with and without the tier (float32, CPU).

Primitives: ``ModelConfig``, ``TinyModel``, ``Engine.generate(prompt,
max_new, use_tier) -> Generation``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..client import Client, ShmKVCache, block_hashes
from .config import ModelConfig


class TinyModel:
    """Pre-norm decoder: learned positions, multi-head attention, GELU MLP."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)
        rnd = lambda *shape, scale: torch.randn(*shape, generator=g) * scale  # noqa: E731
        d = cfg.dim
        self.tok = rnd(cfg.vocab, d, scale=1.0)
        self.pos = rnd(cfg.max_pos, d, scale=0.1)
        self.layers = [{"qkv": rnd(d, 3 * d, scale=d ** -0.5), "o": rnd(d, d, scale=d ** -0.5),
                        "up": rnd(d, cfg.ffn, scale=d ** -0.5), "down": rnd(cfg.ffn, d, scale=cfg.ffn ** -0.5)}
                       for _ in range(cfg.layers)]
        self.out = rnd(d, cfg.vocab, scale=d ** -0.5)

    def forward(self, tokens: list[int], start: int, caches: list[torch.Tensor], table: list[int]) -> torch.Tensor:
        """Run positions ``start..start+len(tokens)`` (within one block), write
        their K/V into ``table``'s block, attend over all cached positions,
        and return the logits of the last position."""
        cfg = self.cfg
        bs, H, D = cfg.block_size, cfg.heads, cfg.head_dim
        T, end = len(tokens), start + len(tokens)
        assert start // bs == (end - 1) // bs, "a chunk must stay inside one block"
        x = self.tok[torch.tensor(tokens)] + self.pos[start:end]
        blk, off = table[start // bs], start % bs
        used = torch.tensor(table[:(end - 1) // bs + 1])
        causal = torch.arange(end).view(1, end) <= torch.arange(start, end).view(T, 1)
        for w, cache in zip(self.layers, caches):
            q, k, v = (_norm(x) @ w["qkv"]).view(T, 3, H, D).unbind(1)
            cache[blk, 0, off:off + T] = k
            cache[blk, 1, off:off + T] = v
            kv = cache[used]                                    # (blocks, 2, bs, H, D)
            keys = kv[:, 0].reshape(-1, H, D)[:end].transpose(0, 1)
            vals = kv[:, 1].reshape(-1, H, D)[:end].transpose(0, 1)
            scores = (q.transpose(0, 1) @ keys.transpose(1, 2)) / math.sqrt(D)
            att = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ vals
            x = x + att.transpose(0, 1).reshape(T, cfg.dim) @ w["o"]
            x = x + torch.nn.functional.gelu(_norm(x) @ w["up"]) @ w["down"]
        return _norm(x[-1]) @ self.out


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@dataclass
class Generation:
    tokens: list[int]
    logits: torch.Tensor               # (max_new, vocab): logits behind each generated token
    ttft_s: float                      # request start -> first token chosen
    prompt_blocks: int                 # full blocks in the prompt (hashed)
    hit_blocks: int = 0                # loaded from kvtier instead of computed
    loaded_bytes: int = 0
    stored_blocks: int = 0             # newly stored (the daemon skips known blocks)
    prefilled_tokens: int = 0
    lookup_s: float = 0.0             # parts of ttft_s spent asking the tier and loading from it
    load_s: float = 0.0
    snapshot: list = field(default_factory=list, repr=False)  # KV of the first blocks, if asked


class Engine:
    """One engine worker: a model, a small paged KV cache, optionally a kvtier client."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, client: Client | None = None):
        self.cfg, self.model, self.client = cfg, TinyModel(cfg), client
        shape = (num_blocks, 2, cfg.block_size, cfg.heads, cfg.head_dim)
        self.kv = ShmKVCache([shape] * cfg.layers, torch.float32)
        self.free = list(range(num_blocks))
        self.block_bytes = cfg.layers * 2 * cfg.block_size * cfg.dim * 4
        if client is not None:
            client.register_kv_cache(self.kv, [0] * cfg.layers, cfg.namespace())

    def generate(self, prompt: list[int], max_new: int, use_tier: bool, snapshot_blocks: int = 0) -> Generation:
        bs = self.cfg.block_size
        table = self._allocate(-(-(len(prompt) + max_new) // bs))
        try:
            t0 = time.perf_counter()
            hashes = block_hashes(prompt, bs)
            gen = Generation([], torch.empty(0), 0.0, len(hashes))
            done = self._load_prefix(hashes, table, len(prompt), gen) if use_tier else 0
            gen.prefilled_tokens = len(prompt) - done
            logits = None
            for s in range(done, len(prompt), bs):  # chunks aligned to absolute block starts
                logits = self.model.forward(prompt[s:min(s + bs, len(prompt))], s, self.kv.tensors, table)
            out = [logits]
            gen.tokens.append(int(logits.argmax()))
            gen.ttft_s = time.perf_counter() - t0
            # Offload the prompt's full blocks while decoding: decode writes only
            # later blocks, and the table is not freed before the store finished.
            store = self.client.store(hashes, table[:len(hashes)]) if use_tier and hashes else None
            for i in range(max_new - 1):
                out.append(self.model.forward([gen.tokens[-1]], len(prompt) + i, self.kv.tensors, table))
                gen.tokens.append(int(out[-1].argmax()))
            gen.logits = torch.stack(out)
            if store is not None:
                result = store.wait()
                gen.stored_blocks = result.done
            gen.snapshot = [t[table[:snapshot_blocks]].clone() for t in self.kv.tensors]
            return gen
        finally:
            self.free.extend(table)  # back of the list: the next request gets other blocks

    def _load_prefix(self, hashes: list[bytes], table: list[int], prompt_len: int, gen: Generation) -> int:
        """Load the longest cached prefix; returns how many prompt tokens it covers."""
        t0 = time.perf_counter()
        hits = self.client.lookup(hashes)
        hits = min(hits, (prompt_len - 1) // self.cfg.block_size)  # the last token is always computed
        t1 = time.perf_counter()
        if hits:
            result = self.client.load(hashes[:hits], table[:hits]).wait()
            if result.failed:  # recompute from the first block that did not arrive
                hits = min(result.failed)
        gen.lookup_s, gen.load_s = t1 - t0, time.perf_counter() - t1
        gen.hit_blocks, gen.loaded_bytes = hits, hits * self.block_bytes
        return hits * self.cfg.block_size

    def _allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"request needs {n} KV blocks, engine has {len(self.free)} free")
        table, self.free = self.free[:n], self.free[n:]
        return table

    def close(self) -> None:
        self.kv.close()
