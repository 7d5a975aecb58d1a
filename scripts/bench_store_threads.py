#!/usr/bin/env python3
"""Torch's intra-op threads in the daemon: what a store costs with them and without,
on a quiet machine and on one whose cores are busy (BENCHMARKS.md 13.4).

A store's gather (engine blocks -> pool rows) is a torch ``index_select``, which
torch splits over its OpenMP threads (one per core by default). An OpenMP
region waits for its slowest thread, so when other processes keep the cores
busy (CPU engines at work) one descheduled thread holds the whole copy.

Two daemons run side by side, RAM only, neither with ``OMP_NUM_THREADS`` set:
one of ``--before`` (another checkout) and one of this checkout. One engine
per daemon stores new chains of ``--blocks`` x 256 KiB blocks (4 layers of
64 KiB, the shape of ``bench_disk.py``), in turn between the two, first with
the machine quiet, then with ``--hogs`` busy processes (default: one per
core, at the same priority) running. Printed: store p50/p99 and the daemons'
CPU per store, per phase.

    python scripts/bench_store_threads.py --before DIR [--stores 300] [--blocks 16] [--hogs N] [--json FILE]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import benchlib as bl
import torch

from bench_disk import LAYERS, NS, SHAPE, key
from kvtier.client import Client, ShmKVCache
from kvtier.demo.daemon_proc import PrivateDaemon

POOL = 256 * 2**20


def hog() -> None:
    while True:
        pass


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def phase(clients: dict, daemons: dict, stores: int, blocks: int, tag: int) -> dict:
    lat = {k: [] for k in clients}
    cpu0 = {k: cpu_s(d.proc.pid) for k, d in daemons.items()}
    for i in range(stores):
        for name in (list(clients) if i % 2 else list(clients)[::-1]):
            hs = [key(tag, i, j) for j in range(blocks)]
            t0 = time.perf_counter()
            if not clients[name].store(hs, list(range(i % 8 * blocks, (i % 8 + 1) * blocks))).wait().ok:
                raise SystemExit(f"{name}: store {i} failed")
            lat[name].append(time.perf_counter() - t0)
    return {k: (bl.pct(v, 50) * 1e3, bl.pct(v, 99) * 1e3, (cpu_s(daemons[k].proc.pid) - cpu0[k]) / stores * 1e3)
            for k, v in lat.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the other checkout (its kvtier runs the 'before' daemon)")
    ap.add_argument("--stores", type=int, default=300, help="stores per daemon per phase")
    ap.add_argument("--blocks", type=int, default=16, help="256 KiB blocks per store (at most 32)")
    ap.add_argument("--hogs", type=int, default=len(os.sched_getaffinity(0)))
    bl.add_json_flag(ap)
    a = ap.parse_args()
    if not 1 <= a.blocks <= 32 or a.stores < 10 or a.hogs < 0:
        ap.error("--blocks must be 1-32, --stores at least 10, --hogs at least 0")
    if not os.path.isdir(os.path.join(a.before, "kvtier")):
        ap.error(f"--before {a.before} is not a kvtier checkout")
    os.environ.pop("OMP_NUM_THREADS", None)  # the daemons start with torch's default threads
    trees = {"before": os.path.abspath(a.before), "after": bl.REPO}
    daemons, clients, kvs, hogs = {}, {}, [], []
    report: dict = {"trees": trees, "blocks": a.blocks, "stores": a.stores, "hogs": a.hogs, **bl.machine_notes()}
    try:
        for name, tree in trees.items():
            daemons[name] = PrivateDaemon(pool_size=str(POOL), slab_size=str(16 * 2**20),
                                          extra=("--config", os.devnull), env={"PYTHONPATH": tree})
            kv = ShmKVCache([SHAPE] * LAYERS, torch.float16)
            kvs.append(kv)
            c = Client(daemons[name].socket, name=f"engine-{name}", timeout=60)
            c.register_kv_cache(kv, [0] * LAYERS, NS)
            clients[name] = c
        phase(clients, daemons, 20, a.blocks, 0)  # warm both (first touches, OpenMP's threads)
        load = {"quiet": os.getloadavg()[0]}
        quiet = phase(clients, daemons, a.stores, a.blocks, 1)
        ctx = mp.get_context("spawn")
        hogs = [ctx.Process(target=hog, daemon=True) for _ in range(a.hogs)]
        for p in hogs:
            p.start()
        time.sleep(2.0)
        busy = phase(clients, daemons, a.stores, a.blocks, 2)
        load["busy"] = os.getloadavg()[0]
        report["daemon_threads"] = {k: threads_of(d.proc.pid) for k, d in daemons.items()}
    finally:
        for p in hogs:
            p.kill()
        bl.release(clients.values(), daemons.values(), kvs)
    rows = [[ph, name, *res[name]] for ph, res in (("quiet", quiet), (f"{a.hogs} busy processes", busy))
            for name in trees]
    report.update(rows=rows, load=load)
    mib = a.blocks * 256 // 1024
    title = (f"{a.stores} stores of {a.blocks} x 256 KiB ({mib} MiB) per daemon per phase, in turn; "
             f"daemon threads at the end {report['daemon_threads']}; load {load}")
    bl.emit(report, [bl.table(["phase", "daemon", "store p50 ms", "p99 ms", "daemon CPU ms per store"], rows, title)],
            a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
