"""What an SGLang HiCache page is called in kvtier: settings, namespace, key.

Pure functions over plain values (no SGLang import), so they are tested and
used the same in every SGLang rank process.

* Key: SGLang names a page by a string (a chained sha256 hex digest of the
  page's tokens and everything before it). blake2b-128 of that string is the
  kvtier key: deterministic in every process, any string length.
* Namespace: everything that changes a page's bytes. The model (its name in
  SGLang's storage config, plus ``kvtier_model_revision`` when given), the
  host pool's dtype, the pool kind and layout (MHA or MLA; the layout sets the
  byte order of a page), tokens per page, the page's shape, PP stage and
  context-parallel ranks (attention CP, MLA's decode CP). MHA pages hold this TP rank's heads: TP rank and
  size are part of the namespace. MLA's latent KV is the same on every TP
  rank: one namespace (rank 0 of 1) for every TP size, SGLang writes it from
  one rank and every rank loads it. The data-parallel rank is not part of it:
  DP replicas compute the same bytes and share them.

Primitives: ``page_key(key)``, ``Settings.parse(extra_config)``,
``PageIdentity`` with ``namespace()``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Mapping

from ...client import Namespace

_PERSON = b"kvtier-sglang"  # keys only SGLang pages map to (vLLM's use another derivation)
# The dynamic-backend fields SGLang itself reads from the same dict.
_SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "allocator")
_OURS = ("kvtier_socket", "kvtier_token", "kvtier_model_revision", "kvtier_namespace_extra",
         "kvtier_staging_mib", "kvtier_timeout_s")
MAX_STAGING_MIB = 4096


def page_key(key: str) -> bytes:
    """16-byte kvtier key of an SGLang page key (TypeError for a non-string)."""
    if not isinstance(key, str):
        raise TypeError(f"SGLang page keys are strings, got {type(key).__name__}")
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16, person=_PERSON).digest()


@dataclass(frozen=True)
class Settings:
    """The backend's own keys of ``--hicache-storage-backend-extra-config``."""
    socket: str | None = None        # default: as for any kvtier client ($KVTIER_SOCKET, /run/kvtier, ...)
    token: str = ""                  # default: $KVTIER_TOKEN
    model_revision: str = ""
    namespace_extra: str = ""        # anything else that changes the bytes (quantization, a LoRA)
    staging_mib: int = 64            # per direction: pages pass through it between the host pool and the daemon
    timeout_s: float = 5.0

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> "Settings":
        """Validated settings; ValueError naming the key for a bad or unknown one."""
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k.startswith("kvtier_") and k not in _OURS)
        if unknown:
            raise ValueError(f"unknown kvtier setting(s) {unknown}; known: {list(_OURS)}")
        out = {}
        for key, field in (("kvtier_socket", "socket"), ("kvtier_token", "token"),
                           ("kvtier_model_revision", "model_revision"),
                           ("kvtier_namespace_extra", "namespace_extra")):
            if key in extra:
                if not isinstance(extra[key], str) or "|" in extra[key] or "\x00" in extra[key]:
                    raise ValueError(f"{key} must be a string without '|' or NUL, got {extra[key]!r}")
                out[field] = extra[key]
        if "kvtier_staging_mib" in extra:
            v = extra["kvtier_staging_mib"]
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_STAGING_MIB:
                raise ValueError(f"kvtier_staging_mib must be an integer from 1 to {MAX_STAGING_MIB}, got {v!r}")
            out["staging_mib"] = v
        if "kvtier_timeout_s" in extra:
            v = extra["kvtier_timeout_s"]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.1 <= v <= 600:
                raise ValueError(f"kvtier_timeout_s must be a number from 0.1 to 600, got {v!r}")
            out["timeout_s"] = float(v)
        settings = cls(**out)
        if not settings.token:
            settings = cls(**{**out, "token": os.environ.get("KVTIER_TOKEN", "")})
        return settings


@dataclass(frozen=True)
class PageIdentity:
    """The facts about one SGLang rank's host pool that decide what it shares."""
    model: str
    revision: str
    dtype: str                  # kvtier's name of the host pool's dtype
    mla: bool
    layout: str                 # the host pool's layout ("layer_first", "page_first", ...)
    page_size: int              # tokens per page
    page_shape: tuple[int, ...] # one page's shape in the host pool's byte order
    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0            # attention context parallelism: each rank holds a slice of every page
    cp_size: int = 1
    dcp_rank: int = 0           # decode context parallelism (MLA): each rank holds a slice of every page
    dcp_size: int = 1
    extra: str = ""

    def __post_init__(self):
        if not self.model:
            raise ValueError("SGLang's storage config names no model; kvtier shares pages per model")
        for name, rank, size in (("PP", self.pp_rank, self.pp_size), ("CP", self.cp_rank, self.cp_size),
                                 ("DCP", self.dcp_rank, self.dcp_size), ("TP", self.tp_rank, self.tp_size)):
            if not 0 <= rank < size:
                raise ValueError(f"bad {name} rank {rank} of {size}")

    def namespace(self) -> Namespace:
        shape = "x".join(str(n) for n in self.page_shape)
        parts = [f"sglang,page{shape}"]
        if self.pp_size > 1:
            parts.append(f"pp{self.pp_rank}of{self.pp_size}")
        if self.cp_size > 1:
            parts.append(f"cp{self.cp_rank}of{self.cp_size}")
        if self.dcp_size > 1:
            parts.append(f"dcp{self.dcp_rank}of{self.dcp_size}")
        if self.extra:
            parts.append(self.extra)
        kind = "mla" if self.mla else "mha"
        tp_rank, tp_size = (0, 1) if self.mla else (self.tp_rank, self.tp_size)
        return Namespace(model=f"{self.model}@{self.revision or 'local'}", dtype=self.dtype,
                         layout=f"sglang-{kind}-{self.layout}", block_size=self.page_size,
                         tp_rank=tp_rank, tp_size=tp_size, extra=",".join(parts))
