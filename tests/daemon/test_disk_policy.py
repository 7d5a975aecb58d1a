"""The disk tier's order follows the pool's ``policy``: under ``lru`` a file a lookup
counted is young again (tests/daemon/test_disk_lossless.py), under ``fifo`` files
go in the order they were written whatever was used. Real daemons, real files."""

from __future__ import annotations

import signal

from tests.daemon.test_disk_lossless import PER_FILE, drained, store_chains
from tests.daemon.test_disk_tier import chain, disk_env, scanned
from tests.helpers import NS, make_kv


def test_under_fifo_the_disk_drops_the_oldest_written_files_though_a_lookup_hit_them(daemon_factory, tmp_path):
    """Room for 96 files: chains A, B, C fill it. After a restart (all on disk only) a
    lookup hits A; a fourth chain then makes room by dropping A, the first written,
    where ``lru`` would drop B."""
    env = disk_env(tmp_path / "disk", str(96 * PER_FILE), lookup_index="false", policy="fifo")
    sock = str(tmp_path / "d.sock")
    kv = make_kv(seed=25)
    first = daemon_factory(process=True, socket=sock, env=env)
    with first.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        store_chains(c, kv, [1, 2, 3])
    assert drained(first)["blocks"] == 96
    first.stop(signal.SIGTERM)
    d = daemon_factory(process=True, socket=sock, env=env)
    assert scanned(d)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.lookup(chain(1, 32)) == 32  # from the disk: under fifo, no use
        store_chains(c, kv, [4])
        assert drained(d)["dropped"] == 32
        assert [c.lookup(chain(tag, 32)) for tag in (1, 2, 3, 4)] == [0, 32, 32, 32]
