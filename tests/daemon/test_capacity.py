"""Capacity that tells the truth: blocks live in whole slabs, so status reports the
blocks a pool really holds for the block sizes registered, the part of the pool past
the last slab, and the daemon says at start when its pool_size wastes bytes."""

from __future__ import annotations

import subprocess
import sys

from kvtier.cli import main
from kvtier.client import block_hashes
from tests.helpers import NS, make_kv

BLOCK = 16 * 1024  # tests.helpers' cache: 4 layers of 4 KiB per block


def fill(d, blocks: int) -> None:
    """One engine stores ``blocks`` distinct blocks (its 32 cache blocks reused)."""
    kv = make_kv(seed=1)
    with d.client(name="filler") as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
        hashes = block_hashes(list(range(16 * blocks)), 16)
        for start in range(0, blocks, 32):
            part = hashes[start:start + 32]
            assert c.store(part, list(range(len(part)))).wait().ok
    kv.close()


def test_a_pool_of_one_and_a_half_slabs_reports_and_holds_one_slab_of_blocks(daemon_factory, capsys):
    """6 MiB of pool in 4 MiB slabs: status says 4 MiB of capacity, 2 MiB past the last slab,
    and at most 256 blocks of 16 KiB (before: 6 MiB capacity, i.e. 384 blocks by size). 320
    stores leave exactly 256 blocks in the pool; the daemon warned at start."""
    d = daemon_factory(pool_size="6MiB", slab_size="4MiB")
    assert "is not a multiple of slab_size 4194304" in d.read_log()
    fill(d, 320)
    p = d.stats(check=True)["pool"]
    assert (p["capacity_bytes"], p["pool_bytes"], p["tail_bytes"]) == (4 * 2**20, 6 * 2**20, 2 * 2**20)
    assert p["used_bytes"] + p["free_bytes"] + p["waste_bytes"] == p["capacity_bytes"]
    assert p["sizes"] == [{"block_bytes": BLOCK, "stride": BLOCK, "per_slab": 256, "blocks": 256,
                           "max_blocks": 256, "free_blocks": 0}]
    assert p["blocks"] == 256 and p["evictions"] == 64
    assert main(["status", "--socket", d.socket]) == 0
    out = capsys.readouterr().out
    assert "4.00 MiB capacity" in out and "2.00 MiB of the 6.00 MiB pool is past the last slab (unused)" in out
    assert "blocks    16.00 KiB: 256 held, 0 more fit, 256 at most (256 per slab)" in out


def test_a_pool_that_is_a_multiple_of_the_slab_warns_nothing_and_counts_free_room(daemon_factory):
    """8 MiB in 4 MiB slabs: no warning, no tail; 40 blocks stored leave 472 more that fit."""
    d = daemon_factory(pool_size="8MiB", slab_size="4MiB")
    fill(d, 40)
    p = d.stats(check=True)["pool"]
    assert "multiple of slab_size" not in d.read_log()
    assert (p["capacity_bytes"], p["tail_bytes"]) == (8 * 2**20, 0)
    assert [(s["blocks"], s["free_blocks"], s["max_blocks"]) for s in p["sizes"]] == [(40, 472, 512)]


def test_a_pool_smaller_than_one_slab_is_refused_at_start(tmp_path):
    """It could hold no block at all: the real daemon exits 2 (a configuration that can never
    work) naming pool_size and the slab, before mapping anything."""
    out = subprocess.run([sys.executable, "-m", "kvtier.daemon.main", "--socket", str(tmp_path / "s.sock"),
                          "--pool-size", "2MiB", "--slab-size", "4MiB"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "pool_size: must hold at least one slab (4194304 bytes)" in out.stderr
