#!/usr/bin/env python3
"""The lookup mirror over RAM and disk: what a lookup costs with it on and off,
and what it costs a store, with the disk tier on (BENCHMARKS.md section 20).

Two daemons of this checkout run side by side, both with the disk tier on,
one with ``lookup_index = true`` and one with it false. Each holds a chain
in RAM and a chain on disk only (stored, written, evicted from RAM by later
stores). Then, interleaved per iteration (on, off, off, on, ...):

  lookup   p50 of ``Client.lookup`` of N hashes: the RAM chain, the disk
           chain (on: answered from the mirror; off: one round trip)
  store    p50/p99 of a fresh ``STORE_CHAIN``-block store (on: the daemon
           also adds the keys to the mirror table before it replies)

and, in process, what the table update itself costs (``ShmIndexWriter.add``
and ``.remove`` of ``STORE_CHAIN`` keys into a table of the daemon's size).

    python scripts/bench_mirror.py [--lookups 2000] [--stores 400] [--keys 256]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench_disk import BLOCK, LAYERS, NS, SHAPE, daemon, disk_stats, stop
from benchlib import add_json_flag, emit, machine_notes, table

from kvtier.client import Client, ShmKVCache

STORE_CHAIN = 16
POOL = 128 * 2**20          # 512 blocks of 256 KiB
DISK = 2 * 2**30


def chain(tag: int, n: int, at: int = 0) -> list[bytes]:
    import hashlib
    return [hashlib.blake2b(bytes([tag]) + (at + i).to_bytes(6, "little"), digest_size=16).digest() for i in range(n)]


def settle(sock: str) -> None:
    while disk_stats(sock)["queued_bytes"]:
        time.sleep(0.01)


def prepare(c: Client, sock: str, keys: int) -> tuple[list[bytes], list[bytes]]:
    """A chain of ``keys`` on disk only, then one of ``keys`` in RAM."""
    disk, ram = chain(1, keys), chain(2, keys)
    for hs in (disk, chain(3, POOL // BLOCK), ram):  # the filler pushes ``disk`` out of RAM
        for s in range(0, len(hs), 64):
            assert c.store(hs[s:s + 64], list(range(64))[:len(hs[s:s + 64])]).wait().ok
            settle(sock)
    return ram, disk


def p(v: list[float], q: float) -> float:
    return sorted(v)[min(len(v) - 1, int(q * len(v)))] * 1e6


def table_update(keys: int, n: int) -> dict:
    from kvtier.pool.shm_index import ShmIndexWriter, segment_name
    w = ShmIndexWriter(segment_name(), keys)
    try:
        w.add(chain(9, keys // 2))
        add, rem = [], []
        for i in range(n):
            hs = chain(10, STORE_CHAIN, i * STORE_CHAIN)
            t0 = time.perf_counter()
            w.add(hs)
            t1 = time.perf_counter()
            w.remove(hs)
            rem.append(time.perf_counter() - t1)
            add.append(t1 - t0)
        return {"add_p50_us": p(add, 0.5), "remove_p50_us": p(rem, 0.5)}
    finally:
        w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--stores", type=int, default=400)
    ap.add_argument("--keys", type=int, default=256, help="hashes per lookup (and per chain; at most half the pool)")
    ap.add_argument("--dir", default="/var/tmp")
    add_json_flag(ap)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kvt-bench-mirror-", dir=a.dir)
    load0 = os.getloadavg()
    procs, clients = {}, {}
    kv = ShmKVCache([SHAPE] * LAYERS, __import__("torch").float16)
    try:
        for mode in ("on", "off"):
            os.environ["KVTIER_LOOKUP_INDEX"] = "true" if mode == "on" else "false"
            sock = os.path.join(work, f"{mode}.sock")
            procs[mode] = (daemon(sock, os.path.join(work, f"disk-{mode}"), DISK, POOL), sock)
            c = Client(sock, name="engine", timeout=60)
            c.register_kv_cache(kv, [0] * LAYERS, NS)
            ram, disk = prepare(c, sock, a.keys)
            assert (c._mirror is not None) == (mode == "on")
            assert c.lookup(disk) == len(disk) and c.lookup(ram) == len(ram), mode
            clients[mode] = c
        times = {(m, k): [] for m in ("on", "off") for k in ("ram", "disk", "store")}
        for i in range(a.lookups):
            for mode in (("on", "off") if i % 2 else ("off", "on")):
                c = clients[mode]
                for kind, keys in (("ram", ram), ("disk", disk)):
                    t0 = time.perf_counter()
                    c.lookup(keys)
                    times[(mode, kind)].append(time.perf_counter() - t0)
        for i in range(a.stores):
            for mode in (("on", "off") if i % 2 else ("off", "on")):
                c = clients[mode]
                hs = chain(20, STORE_CHAIN, i * STORE_CHAIN)
                t0 = time.perf_counter()
                assert c.store(hs, list(range(STORE_CHAIN))).wait().ok
                times[(mode, "store")].append(time.perf_counter() - t0)
        stats = {m: clients[m].stats()["namespaces"][0] for m in ("on", "off")}
        clients["on"].ping()
    finally:
        for c in clients.values():
            c.close()
        for proc, _ in procs.values():
            stop(proc)
        kv.close()
        shutil.rmtree(work, ignore_errors=True)
    update = table_update((POOL + DISK) // BLOCK, 2000)  # a table of the on daemon's size
    load1 = os.getloadavg()
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    rows = [[f"lookup {a.keys} hashes, p50, RAM chain", med[("on", "ram")], med[("off", "ram")],
             med[("off", "ram")] / med[("on", "ram")]],
            [f"lookup {a.keys} hashes, p50, disk chain", med[("on", "disk")], med[("off", "disk")],
             med[("off", "disk")] / med[("on", "disk")]],
            [f"store {STORE_CHAIN} blocks, p50", med[("on", "store")], med[("off", "store")],
             med[("on", "store")] / med[("off", "store")]],
            [f"store {STORE_CHAIN} blocks, p99", p(times[("on", "store")], 0.99), p(times[("off", "store")], 0.99),
             p(times[("on", "store")], 0.99) / p(times[("off", "store")], 0.99)]]
    out = [table(["path (disk tier on)", "mirror on, us", "mirror off, us", "ratio"], rows),
           table(["table update, in process", "us"], [[f"add {STORE_CHAIN} keys, p50", update["add_p50_us"]],
                                                      [f"remove {STORE_CHAIN} keys, p50", update["remove_p50_us"]]]),
           f"Load average at start {load0[0]:.2f}, at end {load1[0]:.2f}; {os.cpu_count()} CPUs; "
           f"disk hits counted by the off daemon: {stats['off']['disk_hits']}"]
    emit({"machine": machine_notes(), "medians_us": {f"{m}/{k}": v for (m, k), v in med.items()},
          "table_update": update, "load": [load0, load1]}, out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
