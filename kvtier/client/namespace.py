"""Namespace fingerprints: the identity under which blocks are shared.

Two engines share prefix blocks only when every field matches: a block
written by model A with TP rank 0 must never be loaded by model B or rank 1.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Namespace:
    model: str                 # checkpoint id, ideally with its revision/hash
    dtype: str                 # e.g. "bfloat16", "fp8_e4m3"
    layout: str                # e.g. "flash_attn", "flashinfer", "mla"
    block_size: int            # tokens per engine block
    tp_rank: int = 0
    tp_size: int = 1
    extra: str = ""            # anything else that changes the bytes (quant config, PP stage)

    def __post_init__(self):
        if not self.model or "|" in self.model:
            raise ValueError("model must be non-empty and contain no '|'")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError("need 0 <= tp_rank < tp_size")

    def fingerprint(self) -> str:
        parts = [self.model, self.dtype, self.layout, f"bs{self.block_size}",
                 f"tp{self.tp_rank}of{self.tp_size}"]
        return "|".join(parts + ([self.extra] if self.extra else []))
