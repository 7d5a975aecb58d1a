#!/usr/bin/env python
# Feeds BENCHMARKS.md section 6.
"""Lookup latency from one thread while another thread of the same Client waits.

    python scripts/bench_client_threads.py [--lookups 200] [--stall 0.5]

A private daemon stalls every copy ``--stall`` seconds (fault injection,
inline copies off), so thread A sits in ``store(...).wait()`` the whole time;
thread B times ``--lookups`` lookups through the same Client.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvtier.client import Client, ShmKVCache  # noqa: E402

import benchlib as bl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lookups", type=int, default=200)
    ap.add_argument("--stall", type=float, default=0.5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sock = os.path.join(tmp, "k.sock")
        env = {**os.environ, "KVTIER_COPY_DELAY_S": str(args.stall), "KVTIER_INLINE_COPY_BYTES": "0"}
        daemon = bl.start_daemon(sock, "64MiB", env=env, extra=("--slab-size", "4MiB", "--log-level", "WARNING"))
        try:
            kv = ShmKVCache([(32, 4096)])
            with Client(sock, timeout=30) as c:
                c.register_kv_cache(kv, [0], "bench|float16|mla|bs1|tp0of1")
                hashes = [bytes([i]) * 16 for i in range(8)]
                stop = threading.Event()

                def waiter():
                    while not stop.is_set():
                        c.store(hashes, list(range(8))).wait()
                        c.flush()

                t = threading.Thread(target=waiter)
                t.start()
                time.sleep(0.2)
                lat = []
                for _ in range(args.lookups):
                    s = time.perf_counter()
                    c.lookup(hashes)
                    lat.append(time.perf_counter() - s)
                stop.set()
                t.join()
            kv.close()
        finally:
            daemon.terminate()
            daemon.wait()
    lat.sort()
    n = len(lat)
    print(f"{n} lookups while another thread waits on {args.stall}s transfers: "
          f"p50 {lat[n // 2] * 1e3:.2f} ms, p99 {lat[min(n - 1, n * 99 // 100)] * 1e3:.2f} ms, "
          f"max {lat[-1] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
