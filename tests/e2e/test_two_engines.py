"""Two engine processes share a prefix through one daemon, byte for byte."""

from __future__ import annotations

import torch

from kvtier.client import Client, Namespace, block_hashes
from tests.helpers import NS, make_kv, spawn

TOKENS = list(range(1000, 1000 + 16 * 12))  # 12 full blocks of a shared prompt


def engine_a_stores(socket: str) -> list:
    """Engine A: prefill wrote blocks 3..14; offload them under the prompt's hashes."""
    kv = make_kv(seed=1)
    with Client(socket, name="engine-a") as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
        hashes = block_hashes(TOKENS, 16)
        result = c.store(hashes, list(range(3, 15))).wait()
        assert result.ok and result.done == 12, result
        expected = [t[3:15].clone() for t in kv.tensors]
    kv.close()
    return [e.numpy().tobytes() for e in expected]


def engine_b_loads(socket: str, fingerprint: str) -> list:
    """Engine B: a fresh process with the same namespace finds and loads the prefix."""
    kv = make_kv(seed=2)
    with Client(socket, name="engine-b") as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), fingerprint)
        hashes = block_hashes(TOKENS + [7, 7, 7], 16)  # same prompt plus a partial tail
        hits = c.lookup(hashes)
        if hits == 0:
            return [hits, []]
        result = c.load(hashes[:hits], list(range(20, 20 + hits))).wait()
        assert result.ok, result
        got = [t[20:20 + hits].clone().numpy().tobytes() for t in kv.tensors]
    kv.close()
    return [hits, got]


def run(target, *args):
    p, q = spawn(target, *args)
    status, value = q.get(timeout=60)
    p.join(30)
    assert status == "ok", value
    return value


def test_engine_b_loads_exactly_what_engine_a_stored(daemon):
    expected = run(engine_a_stores, daemon.socket)
    hits, got = run(engine_b_loads, daemon.socket, NS.fingerprint())
    assert hits == 12
    assert got == expected
    s = daemon.stats()
    ns = s["namespaces"][0]
    assert (ns["blocks"], ns["stored"], ns["loaded"], ns["hits"]) == (12, 12, 12, 12)


def test_other_namespace_sees_nothing(daemon):
    run(engine_a_stores, daemon.socket)
    other = Namespace("tiny-llama", "float16", "flashinfer", 16, tp_rank=1, tp_size=2)
    hits, _ = run(engine_b_loads, daemon.socket, other.fingerprint())
    assert hits == 0
