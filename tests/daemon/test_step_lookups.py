"""What engines do once per scheduling step: look up many requests at once,
and look up and load a prefix in one round trip."""

from __future__ import annotations

import torch

from kvtier.client import KVTierError
from kvtier.protocol import messages as m
from kvtier.protocol.arrays import pack_hashes
from tests.helpers import NS, make_kv

A = [bytes([0x10 + i]) * 16 for i in range(8)]
B = [bytes([0x40 + i]) * 16 for i in range(8)]


def test_lookup_many_answers_each_chain_like_lookup_does(daemon):
    kv = make_kv(seed=1)
    with daemon.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(A[:5], list(range(5))).wait().ok
        assert c.store(B[:2], [8, 9]).wait().ok
        chains = [A, B, A[:3], [bytes(16)] + A, []]
        assert c.lookup_many(chains) == [c.lookup(x) for x in chains] == [5, 2, 3, 0, 0]
        assert c.lookup_many([]) == []
    kv.close()


def test_lookup_many_refuses_oversized_requests_before_unpacking_them(daemon):
    kv = make_kv()
    with daemon.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        reg = c.registration.reg
        huge = [pack_hashes(A)] * 4097
        for bad in (m.LookupMany(reg, huge), m.LookupMany(reg, []), m.LookupMany(reg, [b"x" * 15]),
                    m.LookupMany(reg, ["not bytes"]), m.LookupMany(reg, [bytes(16 * 70_000)])):
            try:
                c.channel.call(bad)
                raise AssertionError(f"{bad!r:.60} was accepted")
            except KVTierError as exc:
                assert exc.code in (1, 3, 9), exc  # BAD_MESSAGE / BAD_ARGUMENT / TOO_LARGE (by its length): the client's fault
        assert c.lookup(A) == 0  # and the daemon serves on
    kv.close()


def test_a_prefix_load_brings_exactly_the_cached_prefix_and_reports_the_rest_as_not_cached(daemon):
    src, dst = make_kv(seed=2), make_kv(seed=3)
    with daemon.client(name="a") as a, daemon.client(name="b") as b:
        a.register_kv_cache(src, [0] * 4, NS)
        b.register_kv_cache(dst, [0] * 4, NS)
        assert a.store(A[:5], list(range(5))).wait().ok
        before = [t.clone() for t in dst.tensors]
        result = b.load(A, list(range(10, 18)), prefix=True).wait()
        assert (result.done, result.failed) == (5, ())
        for s, d, old in zip(src.tensors, dst.tensors, before):
            assert torch.equal(d[10:15], s[0:5])        # the prefix landed
            assert torch.equal(d[15:18], old[15:18])    # nothing past it was touched
        miss = b.load(B, list(range(8)), prefix=True).wait()
        assert (miss.done, miss.failed) == (0, ())
        s = daemon.stats()["namespaces"][0]
        assert (s["loaded"], s["hits"]) == (5, 5)
    src.close()
    dst.close()
