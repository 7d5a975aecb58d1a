"""One soak client: a scripted engine worker that verifies every byte it loads.

Block contents are a pure function of (namespace, block hash), so any worker
can check any block another worker stored, without coordination. Swapped
requests carry content derived from their (unique) request id. Counters live
in a lock-free shared array (``STATS``) because the supervisor SIGKILLs
workers at random: a lock held by a killed worker would hang everyone else.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.client import Client, ShmKVCache

STATS = ("lookups", "loads", "stores", "offloads", "restores", "discards", "bytes_verified",
         "mismatches", "load_failed", "store_no_space", "offload_refused", "restore_failed")
STAT = {name: i for i, name in enumerate(STATS)}


@dataclass(frozen=True)
class Model:
    """A namespace: layer shape (FlashInfer, block dim 0), layers, engine blocks per kvtier block."""
    fingerprint: str
    shape: tuple
    layers: int
    factor: int
    chains: int       # distinct prompts
    max_len: int      # kvtier blocks per prompt, at most

    @property
    def layer_bytes(self) -> int:
        return int(np.prod(self.shape[1:])) * 2  # float16

    @property
    def engine_bytes(self) -> int:
        return self.layer_bytes * self.layers


MODELS = [
    Model("soak-a|float16|flashinfer|bs16|tp0of1", (64, 2, 16, 2, 32), 2, 1, 96, 16),   # 8 KiB blocks
    Model("soak-b|float16|flashinfer|bs16|tp0of1", (64, 2, 16, 4, 32), 2, 2, 64, 12),   # 2 x 16 KiB
]


def chain(model: Model, c: int, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{model.fingerprint}/{c}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def content(seed: bytes, nbytes: int) -> np.ndarray:
    gen = np.random.Generator(np.random.PCG64(int.from_bytes(hashlib.blake2b(seed, digest_size=16).digest())))
    return np.frombuffer(gen.bytes(nbytes), dtype=np.uint8)


class Engine:
    def __init__(self, socket: str, slot: int, stats, stop, seed: int):
        self.rng = random.Random(seed)
        self.model = MODELS[slot % len(MODELS)]
        self.stats, self.stop = stats, stop
        self.tag = f"{os.getpid()}-{seed}"
        self.kv = ShmKVCache([self.model.shape] * self.model.layers)
        # numpy views over the shared KV: [engine block, bytes of that layer]
        self.views = [t.view(self.model.shape[0], -1).view(torch.uint8).numpy()
                      for t in self.kv.tensors]
        self.client = Client(socket, name=f"soak-{slot}", timeout=10.0)
        self.client.register_kv_cache(self.kv, [0] * self.model.layers, self.model.fingerprint,
                                      block_factor=self.model.factor)
        self.swapped: dict[str, int] = {}   # request id -> engine blocks
        self.next_req = 0

    def count(self, name: str, n: int = 1) -> None:
        self.stats[STAT[name]] += n

    # ---- engine blocks ----------------------------------------------------------------
    def write(self, ids: list[int], data: np.ndarray) -> None:
        eb, lb = self.model.engine_bytes, self.model.layer_bytes
        for j, e in enumerate(ids):
            for li, v in enumerate(self.views):
                v[e] = data[j * eb + li * lb:j * eb + (li + 1) * lb]

    def verify(self, ids: list[int], data: np.ndarray) -> None:
        """Engine blocks ``ids`` hold exactly ``data``; counts bytes or one mismatch."""
        eb, lb = self.model.engine_bytes, self.model.layer_bytes
        ok = all(np.array_equal(v[e], data[j * eb + li * lb:j * eb + (li + 1) * lb])
                 for j, e in enumerate(ids) for li, v in enumerate(self.views))
        if ok:
            self.count("bytes_verified", len(ids) * eb)
        else:
            self.count("mismatches")
            print(f"soak worker {self.tag}: MISMATCH in engine blocks {ids}", file=sys.stderr, flush=True)

    def poison(self, ids: list[int]) -> None:
        for v in self.views:
            v[ids] = self.rng.randrange(256)  # a load that silently did nothing is caught

    def block_content(self, h: bytes) -> np.ndarray:
        """The bytes of the kvtier block with hash ``h`` (block_factor engine blocks)."""
        return content(self.model.fingerprint.encode() + h, self.model.factor * self.model.engine_bytes)

    def fresh_ids(self, n: int) -> list[int]:
        return self.rng.sample(range(self.model.shape[0]), n)

    # ---- operations --------------------------------------------------------------------
    def prefix_request(self) -> None:
        """Lookup, load the hits (verify), 'prefill' and store the rest."""
        m, k = self.model, self.model.factor
        hashes = chain(m, self.rng.randrange(m.chains), self.rng.randint(1, m.max_len))
        hits = self.client.lookup(hashes)
        self.count("lookups")
        ids = self.fresh_ids(len(hashes) * k)
        if hits:
            skip = self.rng.randrange(k) if self.rng.random() < 0.3 else 0
            load_ids = ids[skip:hits * k]
            self.poison(load_ids)
            r = self.client.load(hashes[:hits], load_ids, skip=skip).wait()
            self.count("loads")
            self.count("load_failed", len(r.failed))  # evicted after lookup: recompute
            for i in set(range(hits)) - set(r.failed):
                first = skip if i == 0 else 0
                data = self.block_content(hashes[i])
                self.verify(ids[i * k + first:(i + 1) * k], data[first * m.engine_bytes:])
        rest = hashes[hits:]
        for i, h in enumerate(rest):
            self.write(ids[(hits + i) * k:(hits + i + 1) * k], self.block_content(h))
        if rest:
            r = self.client.store(rest, ids[hits * k:]).wait()
            self.count("stores")
            self.count("store_no_space", len(r.failed))

    def swap_out(self) -> None:
        reqs = {}
        for _ in range(self.rng.randint(1, 3)):
            self.next_req += 1
            reqs[f"{self.tag}-r{self.next_req}"] = self.rng.randint(1, 8)
        ids = self.fresh_ids(sum(reqs.values()))
        plan, at = {}, 0
        for rid, n in reqs.items():
            plan[rid] = ids[at:at + n]
            self.write(plan[rid], content(rid.encode(), n * self.model.engine_bytes))
            at += n
        r = self.client.offload(plan).wait()
        self.count("offloads")
        self.count("offload_refused", len(r.failed))
        for rid in reqs:
            if rid not in r.failed_requests:
                self.swapped[rid] = reqs[rid]
        self.poison(ids)  # the engine reuses those blocks at once

    def swap_in(self) -> None:
        rid = self.rng.choice(list(self.swapped))
        n = self.swapped.pop(rid)
        if self.rng.random() < 0.2:
            self.client.discard(rid)  # the request was cancelled
            self.count("discards")
            return
        ids = self.fresh_ids(n)
        self.poison(ids)
        r = self.client.restore(rid, ids).wait()
        self.count("restores")
        if not r.ok:
            self.count("restore_failed")
            print(f"soak worker {self.tag}: restore of {rid} failed: {r}", file=sys.stderr, flush=True)
            return
        self.verify(ids, content(rid.encode(), n * self.model.engine_bytes))

    def run(self) -> None:
        for _ in range(self.rng.randint(20, 600)):  # then exit cleanly (BYE), leaving any swap behind
            if self.stop.value:
                break
            roll = self.rng.random()
            if roll < 0.65:
                self.prefix_request()
            elif roll < 0.85 or not self.swapped:
                self.swap_out()
            else:
                self.swap_in()
        self.client.close()
        if self.rng.random() < 0.5:  # half exit like many engines do: cache left for the daemon's sweep
            self.kv.close()


def main(socket: str, slot: int, stats, stop, seed: int) -> None:
    # Forked from a supervisor that never touched ZeroMQ: this process makes its own context.
    Engine(socket, slot, stats, stop, seed).run()
