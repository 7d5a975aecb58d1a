"""The demo model's configuration (no torch import: the CLI and the
orchestrating process read it without paying for torch)."""

from __future__ import annotations

from dataclasses import dataclass

from ..client.namespace import Namespace


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 4096
    dim: int = 256
    layers: int = 4
    heads: int = 8
    ffn: int = 1024
    block_size: int = 16      # tokens per KV block (= prefill chunk)
    max_pos: int = 16384
    seed: int = 1234

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def namespace(self) -> Namespace:
        # Everything that changes the KV bytes is in the fingerprint.
        return Namespace(f"kvtier-demo-tiny-L{self.layers}-d{self.dim}-h{self.heads}-f{self.ffn}-v{self.vocab}"
                         f"-seed{self.seed}", "float32",
                         "flashinfer", self.block_size)
