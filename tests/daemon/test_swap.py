"""Request swap: offload under pressure, byte-exact restore, quotas, reaping."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from kvtier.client import Client, KVTierError
from kvtier.protocol import ErrorCode
from kvtier.protocol import messages as m
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, make_kv, spawn

BLOCK = 16 * 1024


def prefix_chain(n: int) -> list[bytes]:
    return [i.to_bytes(4, "little") + bytes(12) for i in range(n)]


def preempting_engine(socket: str) -> dict:
    """A scripted engine in its own process: its cache is full, it preempts three
    requests at once, later restores two of them into other blocks and cancels one."""
    kv = make_kv(seed=11)
    out = {}
    with Client(socket, name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        reqs = {"req-a": [0, 1, 2, 3, 4, 5, 6, 7], "req-b": [8, 9, 10], "req-c": [11, 12, 13, 14]}
        saved = {r: [t[ids].clone() for t in kv.tensors] for r, ids in reqs.items()}
        result = c.offload(reqs).wait()
        out["offload"] = (result.done, result.failed_requests, result.no_space)
        out["swap_after_offload"] = c.stats()["swap"]["bytes"]
        for t in kv.tensors:  # the engine reuses those GPU blocks for other requests
            t.normal_()
        # Restore into different block ids: bytes must match exactly.
        targets = {"req-a": [20, 21, 22, 23, 24, 25, 26, 27], "req-b": [31, 30, 29]}
        for r, ids in targets.items():
            assert c.restore(r, ids).wait().ok
            out[f"exact-{r}"] = all(torch.equal(s, t[ids]) for s, t in zip(saved[r], kv.tensors))
        c.discard("req-c")
        s = c.stats()
        out["swap_end"] = s["swap"]["bytes"]
        try:
            c.restore("req-a", targets["req-a"])  # already restored: the space is gone
            out["second_restore"] = c.restore("req-a", targets["req-a"]).wait().error
        except KVTierError as exc:
            out["second_restore"] = str(exc)
    kv.close()
    return out


def test_scripted_engine_offloads_under_pressure_and_restores_exactly(daemon_factory):
    # 2 MiB pool = 128 blocks; a prefix cache fills it first.
    d = daemon_factory(pool_size="2MiB", slab_size="1MiB")
    kv = make_kv(seed=3)
    with d.client(name="prefix-writer") as w:
        w.register_kv_cache(kv, [0] * 4, NS)
        assert w.store(prefix_chain(128), [i % 32 for i in range(128)]).wait().ok
    assert d.stats()["pool"]["free_bytes"] == 0

    p, q = spawn(preempting_engine, d.socket)
    status, out = q.get(timeout=60)
    p.join(10)
    assert status == "ok", out
    assert out["offload"] == (3, (), False)
    assert out["swap_after_offload"] == 15 * BLOCK
    assert out["exact-req-a"] and out["exact-req-b"]
    assert out["swap_end"] == 0
    assert "no swapped request" in out["second_restore"]
    s = d.stats()
    # Room for 15 swapped blocks came from evicting 15 prefix blocks, tails first.
    assert s["namespaces"][0]["evicted"] == 15 and s["pool"]["blocks"] == 113
    with d.client() as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.lookup(prefix_chain(128)) == 113  # the head of the chain survived
    kv.close()


def test_quotas_across_two_clients_and_the_pool_cap(daemon_factory):
    # 2 MiB pool, swap capped at half of it (64 blocks); client quotas of 40 blocks.
    d = daemon_factory(pool_size="2MiB", slab_size="1MiB",
                       env={"KVTIER_SWAP_MAX": "0.5", "KVTIER_SWAP_QUOTA": str(40 * BLOCK)})
    kv1, kv2 = make_kv(seed=1), make_kv(seed=2)
    with d.client(name="one") as a, d.client(name="two") as b:
        a.register_kv_cache(kv1, [0] * 4, NS)
        b.register_kv_cache(kv2, [0] * 4, NS, swap_quota=16 * BLOCK)  # this cache's own, below the operator's
        # One can take 40 blocks, not 41: the 3rd request breaks its quota.
        r = a.offload({"a1": list(range(20)), "a2": list(range(20)), "a3": [0]}).wait()
        assert (r.done, r.failed_requests, r.no_space) == (2, ("a3",), True)
        # Two has its own 16-block quota.
        r = b.offload({"b1": list(range(16)), "b2": [1]}).wait()
        assert (r.done, r.failed_requests) == (1, ("b2",))
        # The pool cap (64 blocks) binds before one's quota once two holds 16:
        # one frees 20 and asks for 20 again -> 40 + 16 = 56 fits; then 9 more would exceed 64.
        a.discard("a1")
        assert a.offload("a4", list(range(20))).wait().ok
        s = d.stats()
        per = {c["name"]: (c["swap_bytes"], c["swap_requests"]) for c in s["clients"]}
        assert per["one"] == (40 * BLOCK, 2) and per["two"] == (16 * BLOCK, 1)
        assert s["swap"]["bytes"] == 56 * BLOCK
        b.discard("b1")
        r = b.offload("b3", list(range(9))).wait()
        assert r.ok  # 40 + 9 = 49 <= 64
        r = b.offload("b4", list(range(8))).wait()
        assert not r.ok and r.no_space  # 49 + 8 = 57 within the cap, but two's quota is 16
        # Swap entries are private: two cannot restore or discard one's request.
        try:
            b.discard("a2")
            raise AssertionError("discard of another client's request must fail")
        except KVTierError as exc:
            assert exc.code == ErrorCode.BAD_ARGUMENT
        assert not b.restore("a2", list(range(20))).wait().ok
    kv1.close()
    kv2.close()


def offload_then_hang(socket: str, ready: str) -> None:
    kv = make_kv(seed=5)
    c = Client(socket, name="doomed")
    c.register_kv_cache(kv, [0] * 4, NS)
    assert c.offload({"x": list(range(16)), "y": list(range(16, 32))}).wait().ok
    open(ready, "w").close()
    time.sleep(60)


def test_killed_client_swap_is_freed(daemon, tmp_path):
    ready = str(tmp_path / "ready")
    p, _ = spawn(offload_then_hang, daemon.socket, ready)
    assert wait_for(lambda: os.path.exists(ready), 120)  # a new interpreter: slow when busy
    assert daemon.stats()["swap"]["bytes"] == 32 * BLOCK
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert wait_for(lambda: daemon.stats()["swap"]["bytes"] == 0, 10)
    s = daemon.stats()
    assert s["swap"]["requests"] == 0 and s["pool"]["used_bytes"] == 0


def test_a_swap_quota_that_is_no_byte_count_is_refused_on_both_sides(daemon):
    """A cache's swap quota is None (the daemon's default), 0 (no swap) or
    bytes. The client refuses anything else before sending; a peer that sends
    a negative quota other than the wire's -1 ("unset") anyway gets a typed
    refusal, nothing is registered, and the daemon serves on."""
    kv = make_kv(seed=12)
    with daemon.client(name="odd-quota") as c:
        for quota in (-1, -(2**40), True, 1.5, "1MiB"):
            with pytest.raises(ValueError):
                c.register_kv_cache(kv, [0] * 4, NS, swap_quota=quota)
        for quota in (-2, -(2**63)):
            with pytest.raises(KVTierError) as exc:
                c.channel.call(m.Register(NS.fingerprint(), [], 1, quota))
            assert exc.value.code == ErrorCode.BAD_ARGUMENT and "swap_quota" in exc.value.message
        assert [r["caches"] for r in daemon.stats()["clients"] if r["name"] == "odd-quota"] == [[]]
        c.register_kv_cache(kv, [0] * 4, NS, swap_quota=None)
        assert c.offload("r", [0, 1]).wait().ok
    kv.close()


def test_the_operators_swap_quota_of_zero_means_no_swap_for_every_cache(daemon_factory):
    """One meaning of 0 everywhere: the operator's ``swap_quota = 0`` (which
    once meant no cap) is no swap, the default and the ceiling of every
    cache, whatever a cache asks for; prefix caching goes on."""
    d = daemon_factory(env={"KVTIER_SWAP_QUOTA": "0"})
    kv = make_kv(seed=13)
    with d.client(name="engine") as a:
        b = a.share()
        a.register_kv_cache(kv, [0] * 4, NS)
        b.register_kv_cache(kv, [0] * 4, NS, swap_quota=1 << 20)
        (row,) = [r for r in d.stats()["clients"] if r["name"] == "engine"]
        assert [q["swap_quota"] for q in row["caches"]] == [0, 0] and row["swap_quota"] == 0
        for c in (a, b):
            r = c.offload("r", [0]).wait()
            assert r.failed_requests == ("r",) and r.no_space
        assert a.store(prefix_chain(2), [0, 1]).wait().ok and b.lookup(prefix_chain(2)) == 2
        assert d.stats()["swap"]["bytes"] == 0
    kv.close()
