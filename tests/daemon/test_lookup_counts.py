"""Status and metrics count every lookup and hit, however it was answered:
lookups a client answers from its lookup mirror never reach the daemon, so
the client reports them (``LookupsAnswered``, on its heartbeat, on ``ping``
and before it closes) and the daemon adds them to the counters socket
lookups use. A report that is negative, inconsistent, too large or names
another client's registration is refused with a typed error and changes
nothing. Real daemons, real ZeroMQ, real mirrors in /dev/shm."""

from __future__ import annotations

import hashlib

import pytest

from kvtier.client.errors import KVTierError
from kvtier.daemon.answered import MAX_LOOKUPS, MAX_ROWS
from kvtier.protocol import messages as m
from kvtier.protocol.errors import ErrorCode
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, make_kv

MIRROR = {"KVTIER_LOOKUP_INDEX": "true"}
HASHES = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(24)]


def row(d) -> dict:
    return d.stats()["namespaces"][0]


def counters(d) -> tuple:
    r = row(d)
    return r["lookups"], r["hits"], r["misses"], r["mirror_lookups"], r["mirror_hits"]


def test_lookups_the_mirror_answers_show_up_in_the_daemons_counters(daemon_factory):
    d = daemon_factory(env=MIRROR)
    kv = make_kv(seed=7)
    with d.client(name="engine", heartbeat=False) as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c._mirror is not None
        assert c.store(HASHES[:10], list(range(10))).wait().ok
        before = counters(d)
        for _ in range(7):
            assert c.lookup(HASHES) == 10  # from shared memory: no round trip
        assert counters(d) == before  # not reported yet
        c.ping()  # carries the report
        assert counters(d) == (before[0] + 7, before[1] + 70, before[2] + 7 * 14, before[3] + 7, before[4] + 70)
        c.ping()  # nothing new: counted once
        assert counters(d)[0] == before[0] + 7
        c.lookup(HASHES[:3])
    # Closing reports the last lookups before the registration goes.
    assert counters(d)[:2] == (before[0] + 8, before[1] + 73)
    kv.close()


def test_a_transfer_carries_the_counts_at_most_every_report_period(daemon_factory, monkeypatch):
    """Ahead of a store or load the counts go at most once per ``REPORT_EVERY`` (one more
    message each way per transfer cost a 4 KiB-block store ~0.05 ms); a management call
    (``stats``) carries them at once, whatever the period."""
    from kvtier.client import connection
    d = daemon_factory(env=MIRROR)
    kv = make_kv(seed=9)
    with d.client(name="engine", heartbeat=False) as c, d.client(name="observer", heartbeat=False) as other:
        c.register_kv_cache(kv, [0] * 4, NS)
        monkeypatch.setattr(connection, "REPORT_EVERY", 0.0)  # every transfer carries them
        assert c.lookup(HASHES) == 0
        assert c.store(HASHES[:4], list(range(4))).wait().ok
        assert other.stats()["namespaces"][0]["mirror_lookups"] == 1
        monkeypatch.setattr(connection, "REPORT_EVERY", 3600.0)  # the last report is too recent
        assert c.store(HASHES[4:5], [4]).wait().ok
        for _ in range(3):
            assert c.lookup(HASHES) == 5
        assert c.store(HASHES[5:6], [5]).wait().ok
        assert c.load(HASHES[:2], [0, 1]).wait().ok
        assert other.stats()["namespaces"][0]["mirror_lookups"] == 1  # not carried: within the period
        assert c.stats()["namespaces"][0]["mirror_lookups"] == 4  # stats carries them at once
    kv.close()


def test_the_heartbeat_reports_what_the_mirror_answered(daemon_factory):
    d = daemon_factory(env=MIRROR)
    kv = make_kv(seed=8)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(HASHES[:4], list(range(4))).wait().ok
        for _ in range(5):
            assert c.lookup(HASHES) == 4
        assert wait_for(lambda: row(d)["mirror_lookups"] == 5)
        assert row(d)["mirror_hits"] == 20
        from kvtier.daemon.metrics import SnapshotCollector
        samples = {s.name: s.value for f in SnapshotCollector(lambda: d.stats()).collect() for s in f.samples}
        assert any(k.startswith("kvtier_mirror_lookups") and v == 5 for k, v in samples.items())
    kv.close()


@pytest.mark.parametrize("counts, code", [
    ([[None, 1, 1, 1]], ErrorCode.BAD_ARGUMENT),             # not an integer
    ([[-1, 1, 1, 1]], ErrorCode.UNKNOWN_NAMESPACE),          # no such registration
    ("reg", ErrorCode.BAD_MESSAGE),                          # not a list (the codec refuses it)
    ([[0, -1, 0, 0]], ErrorCode.BAD_ARGUMENT),               # negative lookups
    ([[0, 1, -5, -5]], ErrorCode.BAD_ARGUMENT),              # negative keys and hits
    ([[0, 1, 5, 6]], ErrorCode.BAD_ARGUMENT),                # more hits than keys
    ([[0, 1, 70000, 1]], ErrorCode.BAD_ARGUMENT),            # more keys than one lookup may ask
    ([[0, MAX_LOOKUPS + 1, 0, 0]], ErrorCode.BAD_ARGUMENT),  # too many for one report
    ([[0, 2**64 - 1, 0, 0]], ErrorCode.BAD_ARGUMENT),        # the largest the wire carries
    ([[0, True, 1, 1]], ErrorCode.BAD_ARGUMENT),             # a bool is no count
    ([[0, 1, 1]], ErrorCode.BAD_ARGUMENT),                   # a short row
    ([[0, 1, 1, 1]] * (MAX_ROWS + 1), ErrorCode.BAD_ARGUMENT),
    ([[0, 3, 3, 3], [0, -3, 0, 0]], ErrorCode.BAD_ARGUMENT),  # one bad row: none is added
])
def test_a_forged_report_gets_a_typed_error_and_changes_nothing(daemon_factory, counts, code):
    d = daemon_factory(env=MIRROR)
    kv = make_kv(seed=9)
    with d.client(name="engine", heartbeat=False) as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        reg = c.registration.reg
        forged = [[reg if r[0] == 0 else r[0], *r[1:]] if isinstance(r, list) and r else r for r in counts] \
            if isinstance(counts, list) else counts
        before = counters(d)
        with pytest.raises(KVTierError) as err:
            c.channel.call(m.LookupsAnswered(forged))
        assert err.value.code == code
        assert counters(d) == before
        c.ping()  # the session is fine
    kv.close()


def test_a_client_cannot_report_for_another_clients_registration(daemon_factory):
    d = daemon_factory(env=MIRROR)
    kv = make_kv(seed=10)
    with d.client(name="victim", heartbeat=False) as v, d.client(name="forger", heartbeat=False) as f:
        v.register_kv_cache(kv, [0] * 4, NS)
        before = counters(d)
        with pytest.raises(KVTierError) as err:
            f.channel.call(m.LookupsAnswered([[v.registration.reg, 100, 100, 100]]))
        assert err.value.code == ErrorCode.UNKNOWN_NAMESPACE
        assert counters(d) == before
    kv.close()
