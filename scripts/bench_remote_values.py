#!/usr/bin/env python
# Feeds BENCHMARKS.md section 7.2 (what framing and verifying a remote value costs, in process).
"""Framing (checksum + MAC) and verifying (MAC) one remote value, in process.

    python scripts/bench_remote_values.py [--runs 5] [--json]

Per size (256 KiB, 4 KiB): ``ValueCodec.frame`` and ``.verify`` over the same
buffer, ``--runs`` runs of at least 200 calls (or 64 MiB), median us per call
and GB/s. To compare trees, run it from each (``cd TREE && python
scripts/bench_remote_values.py``): it imports the kvtier of the working
directory first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())
from kvtier.remote.values import ValueCodec  # noqa: E402

SIZES = (256 * 1024, 4096)


def per_call(fn, calls: int, runs: int) -> float:
    """Median seconds per call over ``runs`` runs of ``calls`` calls."""
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of text")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    codec = ValueCodec(os.urandom(32))
    ns, key = codec.namespace("bench\x1ffingerprint"), os.urandom(16)
    buf = memoryview(bytearray(os.urandom(max(SIZES))))
    rows = []
    for size in SIZES:
        payload, calls = buf[:size], max(200, (64 << 20) // size)
        header, _ = codec.frame(ns, key, payload)
        value = bytes(header) + bytes(payload)
        assert codec.verify(value, ns, key, size).ok
        frame = per_call(lambda: codec.frame(ns, key, payload), calls, args.runs)
        verify = per_call(lambda: codec.verify(value, ns, key, size), calls, args.runs)
        rows.append({"bytes": size, "frame_us": frame * 1e6, "verify_us": verify * 1e6,
                     "frame_gbps": size / frame / 1e9, "verify_gbps": size / verify / 1e9})
    if args.json:
        print(json.dumps({"loadavg": os.getloadavg()[0], "rows": rows}))
        return
    for r in rows:
        print(f"{r['bytes']} B: frame {r['frame_us']:.1f} us ({r['frame_gbps']:.2f} GB/s), "
              f"verify {r['verify_us']:.1f} us ({r['verify_gbps']:.2f} GB/s)")


if __name__ == "__main__":
    main()
