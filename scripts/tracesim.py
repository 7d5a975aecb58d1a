#!/usr/bin/env python3
# Feeds BENCHMARKS.md section 17 and docs/EVICTION.md.
"""Prefix-trace replay in process: hit ratios of eviction policies, and bounds.

    python scripts/tracesim.py [--trace FILE] [--capacities 0.01,0.02,0.05,0.1,0.2,0.4]
                               [--policies lru,lru2,lrfu,arc,lfu,oracle-ever,oracle-count,belady]
                               [--requests N] [--start K] [--disk-x 10] [--full-blocks] [--json FILE]

A trace is one request per line, ``{"timestamp": ms, "hash_ids": [...]}``, each
id one prefix-chained block (``../shared/traces/README.md``). Each request
hits the longest prefix of its ids that the cache holds; then every block of
the request is referenced (the hit ones are read, the rest stored): tail first,
so a chain's head ends most recent and goes last, as in kvtier's own order.
Capacity is in blocks, as a share of the blocks the replayed requests name.
``--full-blocks`` replays only each prompt's full 512-token blocks (the ids
``input_length // 512`` covers), as an engine stores them: a prompt's last,
partial block is never stored or looked up.

Policies (all on the same request sequence):
  lru           kvtier's order (scripts/bench_trace.py checks a real daemon against it)
  lru2          LRU-2: blocks seen once go first, the rest by their previous reference
  lrfu          decayed reference counts, half-life 8 x capacity (in block references)
  arc           adaptive replacement (recency and frequency lists with ghosts)
  lfu           reference count, then recency
  oracle-ever   LRU that knows which blocks are never referenced again (drops them at once)
  oracle-count  knows how many more times each block is referenced (not when): evicts the fewest
  belady        the offline bound: evicts the block referenced farthest in the future
  ram+disk      kvtier's pool of the capacity over its disk tier of --disk-x pools (RamOverDisk)
  lru-combined  one LRU of the pool and the disk together ((1 + --disk-x) x the capacity)
The two oracles bound what knowing a block's future *count* can buy an online
policy; ``belady`` also knows *when*.

Used by scripts/bench_trace.py for its in-process references; run on its own
it prints the policy study of docs/EVICTION.md.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import math
import os
import sys
from collections import OrderedDict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRACE = os.path.join(os.path.dirname(REPO), "shared", "traces", "mooncake_synthetic.jsonl")


def load_trace(path: str, limit: int = 0, start: int = 0) -> list[dict]:
    """The trace's requests in order, from request ``start`` (the first ``limit`` of them if > 0)."""
    try:
        with open(path) as f:
            lines = [line for line in f if line.strip()]
    except OSError as e:
        raise SystemExit(f"cannot read trace {path}: {e.strerror} (docs/EVICTION.md says where the traces come from)")
    reqs = []
    for i, line in enumerate(lines):
        try:
            r = json.loads(line)
        except ValueError:
            raise SystemExit(f"{path}: request {i} is not a JSON object") from None
        if not isinstance(r, dict) or not isinstance(r.get("hash_ids"), list) or \
                not all(isinstance(h, int) for h in r["hash_ids"]):
            raise SystemExit(f"{path}: request {i} has no list of integer hash_ids")
        reqs.append(r)
    reqs = reqs[start:]
    return reqs[:limit] if limit > 0 else reqs


def chains_of(reqs: list[dict], full_blocks: bool = False, block_tokens: int = 512) -> list[list[int]]:
    """Each request's block ids; ``full_blocks``: only those its prompt fills (``input_length``)."""
    if not full_blocks:
        return [r["hash_ids"] for r in reqs]
    for i, r in enumerate(reqs):
        if not isinstance(r.get("input_length"), int) or r["input_length"] < 0:
            raise SystemExit(f"--full-blocks: request {i} has no integer input_length")
    return [r["hash_ids"][:r["input_length"] // block_tokens] for r in reqs]


def working_set(chains: list[list[int]]) -> int:
    return len({b for c in chains for b in c})


def references(chains: list[list[int]]) -> int:
    return sum(len(c) for c in chains)


class _Heap:
    """Evict the smallest key; a block's key is replaced at each reference (lazy deletion)."""

    def __init__(self):
        self.heap, self.version, self.n = [], {}, 0

    def __contains__(self, b) -> bool:
        return b in self.version

    def __len__(self) -> int:
        return len(self.version)

    def put(self, b, key) -> None:
        self.n += 1
        self.version[b] = self.n
        heapq.heappush(self.heap, (key, self.n, b))

    def pop(self):
        while True:
            _key, v, b = heapq.heappop(self.heap)
            if self.version.get(b) == v:
                del self.version[b]
                return b


class KeyPolicy:
    """A policy given by a key per reference, ``key(time, depth, history, block)``
    (sortable; the smallest is evicted). ``before(ids)`` runs first at each request."""

    def __init__(self, capacity: int, key, before=None):
        self.capacity, self.key, self.before, self.cache, self.now = capacity, key, before, _Heap(), 0
        self.history: dict[int, list[int]] = collections.defaultdict(list)

    def __contains__(self, b) -> bool:
        return b in self.cache

    def request(self, ids: list[int]) -> None:
        if self.before is not None:
            self.before(ids)
        for d in range(len(ids) - 1, -1, -1):  # tail first: the head ends most recent
            b = ids[d]
            h = self.history[b]
            h.append(self.now)
            del h[:-2]
            self.cache.put(b, self.key(self.now, d, h, b))
        self.now += len(ids)
        while len(self.cache) > self.capacity:
            self.cache.pop()


def lru(capacity: int) -> KeyPolicy:
    return KeyPolicy(capacity, lambda t, d, h, b: (t, -d))  # one request's blocks: the deepest goes first


def lru2(capacity: int) -> KeyPolicy:
    return KeyPolicy(capacity, lambda t, d, h, b: (h[-2] if len(h) > 1 else -1, t, -d))


def lfu(capacity: int) -> KeyPolicy:
    seen = collections.Counter()
    return KeyPolicy(capacity, lambda t, d, h, b: (seen[b], t, -d), before=seen.update)


def lrfu(capacity: int, half_life_capacities: float = 8.0) -> KeyPolicy:
    """Decayed counts: C <- C * 2^(-dt/H) + 1; the score now is log2(C) - (now - t)/H,
    so log2(C) + t/H, fixed between references, orders blocks as the score does."""
    half_life = max(1.0, capacity * half_life_capacities)
    state: dict[int, tuple[float, int]] = {}

    def key(t, d, h, b):
        c, last = state.get(b, (0.0, t))
        c = c * 2 ** (-(t - last) / half_life) + 1
        state[b] = (c, t)
        return (math.log2(c) + t / half_life, -d)
    return KeyPolicy(capacity, key)


class ARC:
    """Megiddo and Modha's adaptive replacement cache, one reference at a time."""

    def __init__(self, capacity: int):
        self.c, self.p = capacity, 0.0
        self.t1, self.t2, self.b1, self.b2 = OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict()

    def __contains__(self, b) -> bool:
        return b in self.t1 or b in self.t2

    def _replace(self, in_b2: bool) -> None:
        if self.t1 and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p)):
            self.b1[self.t1.popitem(last=False)[0]] = None
        else:
            self.b2[self.t2.popitem(last=False)[0]] = None

    def _ref(self, x) -> None:
        c = self.c
        if x in self.t1:
            del self.t1[x]
            self.t2[x] = None
        elif x in self.t2:
            self.t2.move_to_end(x)
        elif x in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1))
            self._replace(False)
            del self.b1[x]
            self.t2[x] = None
        elif x in self.b2:
            self.p = max(0, self.p - max(len(self.b1) / len(self.b2), 1))
            self._replace(True)
            del self.b2[x]
            self.t2[x] = None
        else:
            l1 = len(self.t1) + len(self.b1)
            if l1 == c:
                if len(self.t1) < c:
                    self.b1.popitem(last=False)
                    self._replace(False)
                else:
                    self.t1.popitem(last=False)
            elif l1 < c and l1 + len(self.t2) + len(self.b2) >= c:
                if l1 + len(self.t2) + len(self.b2) == 2 * c:
                    self.b2.popitem(last=False)
                self._replace(False)
            self.t1[x] = None

    def request(self, ids: list[int]) -> None:
        for b in reversed(ids):
            self._ref(b)


class _Future:
    """Per block, the request indices that reference it, consumed as the replay goes."""

    def __init__(self, chains: list[list[int]]):
        self.uses: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        for i, c in enumerate(chains):
            for b in dict.fromkeys(c):
                self.uses[b].append(i)

    def advance(self, ids: list[int]) -> None:
        for b in dict.fromkeys(ids):
            self.uses[b].popleft()

    def next_use(self, b) -> float:
        q = self.uses[b]
        return q[0] if q else math.inf

    def left(self, b) -> int:
        return len(self.uses[b])


def belady(capacity: int, chains: list[list[int]]) -> KeyPolicy:
    future = _Future(chains)
    return KeyPolicy(capacity, lambda t, d, h, b: (-future.next_use(b), -d), before=future.advance)


def oracle_count(capacity: int, chains: list[list[int]]) -> KeyPolicy:
    future = _Future(chains)
    return KeyPolicy(capacity, lambda t, d, h, b: (future.left(b), t, -d), before=future.advance)


class OracleEver:
    """LRU, except that a block never referenced again is dropped at once."""

    def __init__(self, capacity: int, chains: list[list[int]]):
        self.capacity, self.cache, self.future = capacity, OrderedDict(), _Future(chains)

    def __contains__(self, b) -> bool:
        return b in self.cache

    def request(self, ids: list[int]) -> None:
        self.future.advance(ids)
        for b in reversed(ids):
            if not self.future.left(b):
                self.cache.pop(b, None)
                continue
            self.cache[b] = None
            self.cache.move_to_end(b)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)


class RamOverDisk:
    """kvtier's RAM pool (LRU, ``ram`` blocks) over its disk tier (``disk`` blocks), as the
    daemon runs them: every block a store commits is also written to disk (the disk is
    inclusive: the blocks in RAM are on disk too, unless the disk dropped them), in the
    request's order, head first; a lookup finds the longest prefix held by either tier and
    the disk blocks it counts past the RAM prefix are a use (the disk drops its least
    recently used first); a disk hit is read back into RAM. ``bench_trace.py``'s disk rows
    are compared with it, and with one LRU of ``ram + disk`` blocks (an exclusive pair)."""

    def __init__(self, ram: int, disk: int):
        self.ram, self.disk, self.disk_capacity = lru(ram), OrderedDict(), disk

    def __contains__(self, b) -> bool:
        return b in self.ram or b in self.disk

    def request(self, ids: list[int]) -> None:
        r = 0
        while r < len(ids) and ids[r] in self.ram:
            r += 1
        n = r
        while n < len(ids) and ids[n] in self:
            n += 1
        used = [b for b in ids[r:n] if b in self.disk]
        written = [b for b in ids[n:] if b not in self.disk]
        self.ram.request(ids)  # hits refreshed, disk hits read back, the rest stored
        for b in used + written:
            self.disk[b] = None
            self.disk.move_to_end(b)
        while len(self.disk) > self.disk_capacity:
            self.disk.popitem(last=False)


class Infinite:
    def __init__(self):
        self.seen: set = set()

    def __contains__(self, b) -> bool:
        return b in self.seen

    def request(self, ids: list[int]) -> None:
        self.seen.update(ids)


def make(policy: str, capacity: int, chains: list[list[int]], disk_x: float = 0):
    if policy == "infinite":
        return Infinite()
    if policy == "ram+disk":
        return RamOverDisk(capacity, int(capacity * disk_x))
    if policy == "lru-combined":  # RAM and disk as one LRU cache of their summed size
        return lru(capacity + int(capacity * disk_x))
    simple = {"lru": lru, "lru2": lru2, "lfu": lfu, "lrfu": lrfu, "arc": ARC}
    if policy in simple:
        return simple[policy](capacity)
    oracles = {"belady": belady, "oracle-count": oracle_count, "oracle-ever": OracleEver}
    if policy in oracles:
        return oracles[policy](capacity, chains)
    import tracepolicies  # the ideas tried after the first study (imports this module)
    if policy in tracepolicies.POLICIES:
        return tracepolicies.POLICIES[policy](capacity)
    raise SystemExit(f"unknown policy {policy!r}")


def hit_ratio(policy: str, capacity: int, chains: list[list[int]], disk_x: float = 0) -> float:
    """Blocks hit (longest cached prefix per request) over blocks referenced.
    ``disk_x``: the disk tier's size in pools, for ``ram+disk`` and ``lru-combined``."""
    cache, hits = make(policy, capacity, chains, disk_x), 0
    for ids in chains:
        k = 0
        while k < len(ids) and ids[k] in cache:
            k += 1
        hits += k
        cache.request(ids)
    return hits / max(1, references(chains))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--capacities", default="0.01,0.02,0.05,0.1,0.2,0.4")
    ap.add_argument("--policies", default="lru,lru2,lrfu,arc,lfu,oracle-ever,oracle-count,belady")
    ap.add_argument("--requests", type=int, default=0, help="replay only N requests")
    ap.add_argument("--start", type=int, default=0, help="from request START (a later part of the trace)")
    ap.add_argument("--disk-x", type=float, default=10.0,
                    help="ram+disk and lru-combined: the disk tier holds this many pools of blocks")
    ap.add_argument("--full-blocks", action="store_true",
                    help="replay only the full blocks of each prompt (an engine stores no partial block)")
    ap.add_argument("--json", default="", help="also write the table as JSON to this file")
    args = ap.parse_args(argv)
    if not args.disk_x > 0 or math.isinf(args.disk_x):
        raise SystemExit(f"--disk-x must be a positive number of pools, not {args.disk_x}")
    chains = chains_of(load_trace(args.trace, args.requests, args.start), args.full_blocks)
    ws = working_set(chains)
    policies = args.policies.split(",")
    print(f"{os.path.basename(args.trace)}: {len(chains)} requests, working set {ws} blocks, "
          f"{references(chains)} references, infinite-cache hit ratio {hit_ratio('infinite', 0, chains):.3f}")
    print(f"{'capacity':>9} {'blocks':>7} " + " ".join(f"{p:>12}" for p in policies))
    rows = []
    for share in (float(x) for x in args.capacities.split(",")):
        cap = max(1, int(ws * share))
        row = {"capacity": share, "blocks": cap, **{p: hit_ratio(p, cap, chains, args.disk_x) for p in policies}}
        rows.append(row)
        print(f"{share:>9.0%} {cap:>7} " + " ".join(f"{row[p]:>12.3f}" for p in policies), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": args.trace, "requests": len(chains), "working_set": ws, "full_blocks": args.full_blocks,
                       "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
