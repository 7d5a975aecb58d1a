"""The daemon's own memory stays flat under a store storm; oversize pools are refused.

RSS is measured outside the pool: ``rss - shared`` from statm is RssAnon
(heap, stacks, private maps), since the pool and the clients' KV segments are
shmem pages and count as 'shared'. USS would not do: pool pages that only the
daemon maps count as private there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from kvtier.client import Client
from tests.conftest import REPO
from tests.helpers import NS, make_kv, pool_segments

MiB = 2**20
GROWTH_LIMIT = 2 * MiB  # measured: +0.3 MiB once, then flat for 10k cycles


def anon_rss(pid: int) -> int:
    mi = psutil.Process(pid).memory_info()
    return mi.rss - mi.shared


def storm(c: Client, first: int, cycles: int, seconds: float = 0.0) -> int:
    """Store 32 fresh blocks, look up and load some, swap a request out and back,
    flush; repeat ``cycles`` times, and on until ``seconds`` passed. Returns the
    next cycle number. (A count, not a duration: a busy machine makes fewer
    cycles per second, never a weaker test.)"""
    i = first
    deadline = time.monotonic() + seconds
    while i < first + cycles or time.monotonic() < deadline:
        hashes = [i.to_bytes(8, "little") + bytes([k]) * 8 for k in range(32)]
        r = c.store(hashes, list(range(32))).wait()
        assert r.ok and r.done == 32, r
        assert c.lookup(hashes[:8]) == 8
        assert c.load(hashes[:8], list(range(8, 16))).wait().ok
        assert c.offload(f"req-{i}", [1, 2, 3]).wait().ok
        assert c.restore(f"req-{i}", [4, 5, 6]).wait().ok
        assert c.flush() == 32
        i += 1
    return i


def test_store_storm_keeps_daemon_memory_flat(daemon_factory):
    seconds = float(os.environ.get("KVTIER_STORM_SECONDS", "0"))  # set for a longer measurement
    d = daemon_factory(process=True, pool_size="64MiB", slab_size="4MiB")
    kv = make_kv(seed=1)
    with d.client(name="storm") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        n = storm(c, 0, 100)  # warm-up: allocator free lists, pymalloc arenas, torch views
        before = anon_rss(d.proc.pid)
        t0 = time.monotonic()
        cycles = storm(c, n, 600, seconds) - n
        seconds = time.monotonic() - t0
        after = anon_rss(d.proc.pid)
        s = c.stats(check=True)
    growth = after - before
    print(f"\nstore storm: {cycles} cycles in {seconds:.0f} s after {n} warm-up cycles; daemon RSS outside "
          f"the pool {before / MiB:.1f} -> {after / MiB:.1f} MiB (growth {growth / MiB:+.2f} MiB)")
    assert growth < GROWTH_LIMIT, f"daemon grew {growth / MiB:.1f} MiB outside the pool in {cycles} cycles"
    assert s["integrity"] == "ok"
    assert s["pool"]["used_bytes"] == 0 and s["swap"]["bytes"] == 0
    assert s["totals"]["stores"] >= cycles and s["totals"]["restores"] >= cycles
    kv.close()


def start_refused(tmp_path, pool_size: str, *flags: str) -> tuple[int, str]:
    """Run a daemon that must refuse to start; returns (exit status, stderr)."""
    sock = str(tmp_path / "refused.sock")
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.daemon", "--socket", sock, "--pool-size", pool_size,
                             "--slab-size", "64MiB", *flags], env={**os.environ, "PYTHONPATH": REPO},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=120)
    # Refused before the pool was reserved: no segment under its pid, no socket.
    assert not pool_segments(proc.pid)
    assert not os.path.exists(sock)
    return proc.returncode, err


def test_pool_above_ram_fraction_is_refused(tmp_path):
    avail = psutil.virtual_memory().available
    cases = [(0.8, f"{int(avail * 2) // MiB}MiB", ()),                      # the default fraction
             (0.05, f"{int(avail * 0.5) // MiB}MiB", ("--ram-fraction", "0.05"))]  # 10x: other
    # processes freeing memory meanwhile cannot make it fit
    for fraction, size, flags in cases:
        rc, err = start_refused(tmp_path, size, *flags)
        assert rc == 2, (rc, err[-2000:])  # unfit config: systemd must not restart-loop
        assert f"exceeds {fraction:.0%} of available RAM" in err, err[-2000:]
        assert "ram_fraction" in err
