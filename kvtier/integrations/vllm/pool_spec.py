"""The pool side of a vLLM offload transfer, owned by both of vLLM's sides:
the scheduler's manager (manager.py) builds it for each load and store it
plans, the worker (worker.py) reads it when the transfer runs. Here so that
neither side imports the other."""

from __future__ import annotations

from vllm.v1.kv_offload.base import LoadStoreSpec


class KVTierSpecs(LoadStoreSpec):
    """The pool side of a load or store: kvtier keys, one per chunk, in order,
    one list per KV cache group (in the engine's group order)."""

    def __init__(self, hashes: list[bytes] | None = None, *, groups: list[list[bytes]] | None = None):
        self.groups = groups if groups is not None else [list(hashes or [])]

    @property
    def hashes(self) -> list[bytes]:
        return [h for g in self.groups for h in g]

    def __repr__(self) -> str:
        return f"KVTierSpecs({[len(g) for g in self.groups]} chunks)"
