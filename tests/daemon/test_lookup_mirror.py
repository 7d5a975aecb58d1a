"""With ``lookup_index`` on, a client of the daemon's user answers lookups from
the shared-memory mirror, and the answers equal the daemon's own through
stores, evictions, flushes and a restart; a client that cannot map the mirror
asks over the socket."""

from __future__ import annotations

import os

from kvtier.client import Namespace
from kvtier.protocol import messages as m
from kvtier.protocol.arrays import pack_hashes
from tests.helpers import NS, make_kv

MIRROR = {"KVTIER_LOOKUP_INDEX": "true"}
HASHES = [bytes([0x60 + i]) * 16 for i in range(24)]


def daemon_answer(client, hashes) -> int:
    return client.channel.call(m.Lookup(client.registration.reg, pack_hashes(hashes))).hits


def test_mirror_answers_equal_the_daemons_through_store_evict_and_flush(daemon_factory):
    d = daemon_factory(env=MIRROR, pool_size="4MiB", slab_size="1MiB")  # room for 256 16 KiB blocks
    kv = make_kv(seed=1)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.registration.index and c._mirror is not None
        assert c.lookup(HASHES) == 0
        assert c.store(HASHES[:10], list(range(10))).wait().ok
        assert c.lookup(HASHES) == daemon_answer(c, HASHES) == 10   # seen as soon as the store is done
        c.ping()  # reports the mirror's lookups so far (tests/daemon/test_lookup_counts.py)
        before = d.stats()["namespaces"][0]["mirror_lookups"]
        for _ in range(5):
            c.lookup(HASHES)
        c.ping()
        assert d.stats()["namespaces"][0]["mirror_lookups"] == before + 5  # no round trip: reported
        # Another namespace fills the pool: the first one's blocks are evicted.
        other = Namespace("other-model", "float16", "flashinfer", 16)
        with d.client(name="filler") as f:
            f.register_kv_cache(kv, [0] * 4, other)
            for i in range(0, 256, 32):
                f.store([bytes([0xF0, i]) * 8 for i in range(i, i + 32)], list(range(32))).wait()
        assert c.lookup(HASHES) == daemon_answer(c, HASHES) < 10
        assert c.store(HASHES[:4], list(range(4))).wait().ok
        assert c.lookup(HASHES) == daemon_answer(c, HASHES)
        c.flush()
        assert c.lookup(HASHES) == daemon_answer(c, HASHES) == 0
    kv.close()


def test_a_client_that_cannot_map_the_mirror_asks_the_daemon(daemon_factory):
    d = daemon_factory(env=MIRROR)
    kv = make_kv(seed=2)
    with d.client(name="writer") as w:
        w.register_kv_cache(kv, [0] * 4, NS)
        assert w.store(HASHES[:3], [0, 1, 2]).wait().ok
        name = w.registration.index
        os.chmod(f"/dev/shm/{name.lstrip('/')}", 0o000)  # as for an engine of another user
        try:
            with d.client(name="stranger") as s:
                if os.geteuid() != 0:  # root maps it anyway; everyone else falls back
                    s.register_kv_cache(kv, [0] * 4, NS)
                    assert s._mirror is None
                    assert s.lookup(HASHES) == 3
        finally:
            os.chmod(f"/dev/shm/{name.lstrip('/')}", 0o600)
    kv.close()


def test_mirrors_are_on_by_default_off_when_asked_and_gone_with_the_daemon(daemon_factory):
    d = daemon_factory(env={"KVTIER_LOOKUP_INDEX": "false"})
    kv = make_kv()
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.registration.index == "" and c._mirror is None
    d2 = daemon_factory()  # the default
    with d2.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        path = "/dev/shm/" + c.registration.index.lstrip("/")
        assert os.path.exists(path)
    d2.stop()
    assert not os.path.exists(path)
    kv.close()
