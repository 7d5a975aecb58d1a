#!/usr/bin/env python
# Feeds BENCHMARKS.md section 15.
"""Stores into one full pool shared by engines of two block sizes, against one size.

    python scripts/bench_size_classes.py [--stores 400] [--no-daemon] [--concurrent] [--profile]

Two engines store fresh chains in turn into a full pool (every store evicts).
"mixed": one engine has 256 KiB blocks (65 per store), the other 64 KiB
blocks (260 per store: the same bytes), so their blocks live in slabs of two
size classes and making room for one may evict whole slabs of the other.
Baselines from the same run, interleaved store by store: both engines with
64 KiB blocks, and both with 256 KiB blocks (one size class each).

1. sans-IO: the real ``BlockIndex`` and ``SlabAllocator`` (no sockets, no
   copies), ``prepare_store`` + ``complete_store`` per store; also how many
   evicted blocks were newer than a block of the storing class that stayed
   (LRU order broken by whole-slab eviction), the share of the pool held by
   blocks no lookup reaches (their chain lost an earlier block), and the hit
   rate when each engine re-reads one of its last ``--window`` chains after
   every store.
2. worst case of the eviction walk: a recent block in every slab of one class
   (a 2 and an 8 GiB pool of 64 MiB slabs), one store of the other class.
3. daemon: one private daemon per case, two clients with their own shared
   KV caches; ``store(...).wait()`` per store ("until done").

Per store, min / p50 / p90 in ms, over the stores after the pool filled.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import sys
import threading
import time

import benchlib as bl

from kvtier.pool import BlockIndex, SlabAllocator

KiB, MiB = 1024, 2**20
CASES = {"mixed": ((256 * KiB, 65), (64 * KiB, 260)),
         "one-size 64K": ((64 * KiB, 260), (64 * KiB, 260)),
         "one-size 256K": ((256 * KiB, 65), (256 * KiB, 65))}


def stats_ms(xs: list[float]) -> tuple[float, float, float]:
    return tuple(round(bl.pct(xs, p) * 1e3, 3) for p in (0, 50, 90))


class SansIO:
    """One case on the bare index: two namespaces storing chains in turn."""

    def __init__(self, engines, pool: int, slab: int, window: int, seed: int, audit: bool):
        self.idx = BlockIndex(SlabAllocator(pool, slab))
        self.engines = [(self.idx.namespace(f"e{i}-{b}", b), n) for i, (b, n) in enumerate(engines)]
        self.chains = [[] for _ in engines]  # stored chains per engine, newest last
        self.window, self.audit = window, audit
        self.rng = random.Random(seed)
        self.counter = 0
        self.times = [[] for _ in engines]
        self.evicted = self.out_of_order = 0
        self.dead: list[float] = []  # unreachable share, sampled
        self.hits = [[0, 0] for _ in engines]   # [blocks hit, blocks asked]

    def fresh(self, n: int) -> list[bytes]:
        self.counter += n
        return [i.to_bytes(16, "little") for i in range(self.counter - n, self.counter)]

    def store(self, i: int, measure: bool) -> None:
        ns, n = self.engines[i]
        keys = self.fresh(n)
        before = self.idx.policy.ages() if self.audit and measure else None
        t0 = time.perf_counter()
        self.idx.complete_store(self.idx.prepare_store(ns, keys))
        dt = time.perf_counter() - t0
        self.chains[i].append(keys)
        if measure:
            self.times[i].append(dt)
            if before is not None:
                self._audit(before, ns.cls)
                if len(self.times[i]) % 10 == 0:
                    self.dead.append(self.unreachable())
            self._reread(i)

    def _audit(self, before: dict, cls: int) -> None:
        # Evicted blocks newer than a block of the storing class that stayed: exact
        # LRU would have evicted that older block first (whole-slab eviction of
        # another class's slab throws its newer blocks away with its oldest).
        now = self.idx.policy.ages()
        gone = [s for e, s in before.items() if e not in now]
        kept = [s for e, s in before.items() if e in now and e.ns.cls == cls]
        self.evicted += len(gone)
        if kept:
            oldest_kept = min(kept)
            self.out_of_order += sum(s > oldest_kept for s in gone)

    def unreachable(self) -> float:
        """Share of the pool's ready bytes in blocks whose chain lost an earlier
        block: no lookup reaches them, yet they take room until they age out."""
        dead = ready = 0
        for (ns, _n), chains in zip(self.engines, self.chains):
            live = ns.ready_map
            for keys in chains:
                have = [k in live for k in keys]
                reach = have.index(False) if False in have else len(have)
                dead += sum(have[reach:]) * ns.block_bytes
            ready += ns.ready * ns.block_bytes
        return dead / max(1, ready)

    def _reread(self, i: int) -> None:
        # The engine asks again for one of its last `window` chains (a prompt prefix coming back).
        ns, n = self.engines[i]
        keys = self.rng.choice(self.chains[i][-self.window:])
        self.hits[i][0] += self.idx.lookup(ns, keys)
        self.hits[i][1] += len(keys)


def run_sansio(args) -> tuple[dict, str]:
    cases = {name: SansIO(eng, args.pool, args.slab, args.window, 7, args.audit) for name, eng in CASES.items()}
    fill = args.pool // (sum(b * n for b, n in CASES["mixed"])) + 2
    prof = cProfile.Profile() if args.profile else None
    for r in range(fill + args.stores):
        for name, c in cases.items():
            for i in range(2):
                if prof and name == "mixed" and r >= fill:
                    prof.enable()
                c.store(i, r >= fill)
                if prof:
                    prof.disable()
    rows, report = [], {}
    for name, c in cases.items():
        c.idx.check_integrity()
        for i, (ns, n) in enumerate(c.engines):
            mn, p50, p90 = stats_ms(c.times[i])
            hit = c.hits[i][0] / max(1, c.hits[i][1])
            dead = f"{sum(c.dead) / len(c.dead):.1%}" if c.dead and i == 0 else ""
            rows.append([name, f"{bl.short_size(ns.block_bytes)} x{n}", mn, p50, p90, f"{hit:.1%}",
                         c.out_of_order if i == 0 else "", c.evicted if i == 0 else "", dead])
            report[f"{name}/{i}"] = {"min_ms": mn, "p50_ms": p50, "p90_ms": p90, "hit_rate": hit}
        report[name + "/out_of_order"] = c.out_of_order
        report[name + "/evicted"] = c.evicted
        report[name + "/unreachable_share"] = sum(c.dead) / len(c.dead) if c.dead else None
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    table = bl.table(["case", "engine", "min ms", "p50 ms", "p90 ms", "re-read hit rate",
                      "evicted newer than a kept block of the storing class", "evicted",
                      "unreachable share of pool (mean)"], rows,
                     f"sans-IO: prepare+complete_store, pool {bl.short_size(args.pool)}, "
                     f"slab {bl.short_size(args.slab)}, {args.stores} rounds")
    return report, table


def run_worst(args) -> tuple[dict, str]:
    """The walk's worst case: every slab of the 64 KiB class holds one recently
    read block, so no slab's blocks are all older than the rest; then the
    256 KiB class stores 65 blocks (the walk passes up to its limit, then takes
    the slab of each next oldest block)."""
    rows, report = [], {}
    for pool in (args.worst_pool // 4, args.worst_pool):
        times = []
        for _ in range(3):
            idx = BlockIndex(SlabAllocator(pool, 64 * MiB))
            x, y = idx.namespace("x", 64 * KiB), idx.namespace("y", 256 * KiB)
            per = 64 * MiB // (64 * KiB)
            keys = [i.to_bytes(16, "little") for i in range(per * (pool // (64 * MiB)))]
            for i in range(0, len(keys), 4096):
                idx.complete_store(idx.prepare_store(x, keys[i:i + 4096]))
            for s in range(0, len(keys), per):
                idx.lookup(x, [keys[s + per - 1]])
            t0 = time.perf_counter()
            plan = idx.prepare_store(y, [b"y" + i.to_bytes(15, "little") for i in range(65)])
            times.append(time.perf_counter() - t0)
            if plan.no_space:
                raise SystemExit("worst case: the store found no room")
            idx.complete_store(plan)
        mn, p50, _ = stats_ms(times)
        rows.append([bl.short_size(pool), len(keys), mn, p50])
        report[bl.short_size(pool)] = {"blocks": len(keys), "min_ms": mn, "p50_ms": p50}
    return report, bl.table(["pool (64MiB slabs)", "64KiB blocks", "min ms", "p50 ms"], rows,
                            "worst case: a recent block in every slab, one 65-block store of the other class")


def run_daemon(args) -> tuple[dict, str]:
    import torch

    from kvtier.client import Client, Namespace, ShmKVCache
    from kvtier.demo.daemon_proc import PrivateDaemon

    bl.use_threads(1)
    daemons, clients, caches = {}, {}, []
    try:
        for name, engines in CASES.items():
            d = daemons[name] = PrivateDaemon(pool_size=str(args.pool), slab_size=str(args.slab),
                                              env={"OMP_NUM_THREADS": "1"})
            for i, (b, n) in enumerate(engines):
                kv = ShmKVCache([(n, b // 2)], torch.float16)
                kv.tensors[0].fill_(1)  # touched, like a live KV cache
                caches.append(kv)
                c = Client(d.socket, name=f"bench-size-{i}", timeout=60, transfer_timeout=600)
                c.register_kv_cache(kv, [0], Namespace("bench-size-classes", "float16", "mla", 16,
                                                       extra=f"e{i}-b{b}"))
                clients[name, i] = (c, n)
        times = {k: [] for k in clients}
        fill = args.pool // (sum(b * n for b, n in CASES["mixed"])) + 2
        burst = args.burst if args.concurrent else 1
        for r in range(0, fill + args.daemon_stores, burst):
            for name in CASES:
                pair = [(key, c, n) for key, (c, n) in clients.items() if key[0] == name]
                if args.concurrent:  # both engines store at once, each `burst` stores back to back
                    threads = [threading.Thread(target=store_run, args=(*p, burst, times if r >= fill else None))
                               for p in pair]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                else:
                    for p in pair:
                        store_run(*p, 1, times if r >= fill else None)
        rows, report = [], {}
        for (name, i), xs in times.items():
            mn, p50, p90 = stats_ms(xs)
            b, n = CASES[name][i]
            rows.append([name, f"{bl.short_size(b)} x{n}", mn, p50, p90])
            report[f"{name}/{i}"] = {"min_ms": mn, "p50_ms": p50, "p90_ms": p90}
        for name, d in daemons.items():
            st = clients[name, 0][0].stats()
            report[name + "/evicted"] = sum(ns.get("evicted", 0) for ns in st.get("namespaces", []))
    finally:
        for c, _n in clients.values():
            c.close()
        for kv in caches:
            kv.close()
        for d in daemons.values():
            d.stop()
    table = bl.table(["case", "engine", "min ms", "p50 ms", "p90 ms"], rows,
                     f"daemon: store(...).wait(), pool {bl.short_size(args.pool)}, slab {bl.short_size(args.slab)}, "
                     f"{args.daemon_stores} rounds")
    return report, table


def store_run(key, client, n: int, count: int, times: dict | None) -> None:
    for _ in range(count):
        hashes = [os.urandom(16) for _ in range(n)]
        t0 = time.perf_counter()
        res = client.store(hashes, list(range(n))).wait()
        dt = time.perf_counter() - t0
        if not res.ok or res.done != n:
            raise SystemExit(f"store failed in {key}: {res}")
        if times is not None:
            times[key].append(dt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", type=bl.parse_size, default=256 * MiB)
    ap.add_argument("--slab", type=bl.parse_size, default=4 * MiB,
                    help="4 MiB: bench_step_calls.py's daemons, where it was seen; the daemon's default is 64 MiB")
    ap.add_argument("--stores", type=int, default=400, help="measured rounds (each engine stores once), sans-IO")
    ap.add_argument("--daemon-stores", type=int, default=60, help="measured rounds through the daemon")
    ap.add_argument("--window", type=int, default=12, help="re-reads pick one of the engine's last N chains")
    ap.add_argument("--no-audit", dest="audit", action="store_false", help="skip the LRU-order audit")
    ap.add_argument("--concurrent", action="store_true", help="daemon: the two engines store at the same time")
    ap.add_argument("--burst", type=int, default=10, help="--concurrent: stores per engine per turn")
    ap.add_argument("--no-daemon", action="store_true")
    ap.add_argument("--worst-pool", type=bl.parse_size, default=8 * 2**30,
                    help="pool of the worst-case walk (and a quarter of it); 0: skip")
    ap.add_argument("--profile", action="store_true", help="cProfile the mixed sans-IO case")
    bl.add_json_flag(ap)
    args = ap.parse_args(argv)
    report, tables = {"machine": bl.machine_notes()}, []
    r, t = run_sansio(args)
    report["sansio"] = r
    tables.append(t)
    if args.worst_pool:
        r, t = run_worst(args)
        report["worst"] = r
        tables.append(t)
    if not args.no_daemon:
        r, t = run_daemon(args)
        report["daemon"] = r
        tables.append(t)
    report["machine"]["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    bl.emit(report, tables, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
