"""A full disk makes room for each write by overwriting a file it evicts (no unlink, no
new file): a real daemon churns a disk of ~200 block files with 20x that many blocks,
written one chain at a time. What is on disk is exactly what the index says, every file
holds the block its name says (the chains still on disk load byte-exact, before and
after a restart's scan, none rejected), evicted blocks are misses, and nothing is left
in tmp/."""

from __future__ import annotations

import os

import torch

from kvtier.disk.format import TMP_DIR
from tests.daemon.test_disk_tier import BLOCK, block_files, chain, disk_env, scanned, written
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, block_bytes, make_kv

CHAIN = 32
CHAINS = 40  # 1,280 blocks through a 4 MiB disk of 20 KiB files (204 of them)


def test_a_full_disk_overwrites_what_it_evicts_and_every_file_is_the_block_it_names(daemon_factory, tmp_path):
    root = tmp_path / "disk"
    env = disk_env(root, "4MiB")
    d = daemon_factory(pool_size="2MiB", slab_size="1MiB", env=env)
    kv = make_kv(seed=5)
    want = {}
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        for tag in range(CHAINS):
            for t in kv.tensors:
                t.copy_(torch.randint_like(t, 0, 255))
            assert c.store(chain(tag, CHAIN), list(range(CHAIN))).wait().ok
            want[tag] = block_bytes(kv, range(CHAIN))
            assert written(d, CHAIN * (tag + 1))  # each chain reaches the disk (nothing dropped)
        s = d.stats()["disk"]
        assert s["written"] == CHAIN * CHAINS and s["dropped"] >= CHAIN * CHAINS - 4 * 2**20 // (BLOCK + 4096)
        counts = {k: s[k] for k in ("written", "recycled", "unlinked", "dropped")}
        files = 4 * 2**20 // (BLOCK + 4096)
        assert s["recycled"] >= CHAIN * CHAINS - 2 * files, counts  # most writes overwrote an evicted file
        assert s["rejected"] == 0 and s["used_bytes"] <= s["capacity_bytes"]
        assert len(block_files(root)) == s["blocks"]
        assert os.listdir(root / TMP_DIR) == []
        last = CHAINS - 1
        assert c.lookup(chain(0, CHAIN)) == 0  # long evicted from RAM and disk
        loaded = check_chains_on_disk(c, kv, want)
        assert last in loaded
    d.stop()
    # A new daemon's scan finds the same files, every one whole.
    d = daemon_factory(pool_size="2MiB", slab_size="1MiB", env=env)
    assert scanned(d)
    s = d.stats()["disk"]
    assert s["scan_rejected"] == 0 and s["blocks"] == len(block_files(root))
    with d.client(name="engine-2") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert check_chains_on_disk(c, kv, want) == loaded
        assert d.stats()["disk"]["rejected"] == 0


def check_chains_on_disk(c, kv, want) -> list[int]:
    """Load every chain's hits (a prefix) byte-exact; the tags of the chains wholly there."""
    whole = []
    for tag, blocks in want.items():
        n = c.lookup(chain(tag, CHAIN))
        if not n:
            continue
        for t in kv.tensors:
            t.zero_()
        r = c.load(chain(tag, CHAIN)[:n], list(range(n))).wait()
        assert r.ok and r.done == n
        assert all(torch.equal(a, b) for a, b in zip(blocks[:n], block_bytes(kv, range(n)))), tag
        if n == CHAIN:
            whole.append(tag)
    return whole
