"""TP-independent layouts (``slices.py``) with vLLM's own worker types and a real daemon.

vLLM's CPU attention keeps a block as ``[heads, tokens, 2 * head_size]``, so
head ``h``'s bytes are the same whichever TP size holds it. Here a TP=1
worker (both heads) and the two ranks of a TP=2 engine (one head each) store
and load through one namespace: bytes exact both ways, a TP=2 store is one
copy, and the scheduler counts a chunk only when every head slice is in the
pool. Replicated KV (MLA) is stored by one rank per chunk and loaded by all.
The full engines are in ``test_vllm_tp.py``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

vllm_base = pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")
from kvtier.client import Namespace  # noqa: E402
from kvtier.integrations.vllm.groups import TierGroup  # noqa: E402
from kvtier.integrations.vllm.manager import KVTierManager, KVTierSpecs  # noqa: E402
from kvtier.integrations.vllm.naming import kvtier_key  # noqa: E402
from kvtier.integrations.vllm.slices import plan, slice_key  # noqa: E402
from kvtier.integrations.vllm.worker import KVTierWorker  # noqa: E402
from tests.integrations.test_vllm_tier_events import offload_keys, req  # noqa: E402
from tests.integrations.test_vllm_worker import finished, gpu_spec  # noqa: E402
from tests.daemon.test_reaping import wait_for  # noqa: E402

LAYERS, BLOCKS, HEADS, HEAD_BYTES, K = 2, 16, 2, 1024, 2
HEADS_NS = Namespace("tp-test", "bfloat16", "vllm-LBHNC", 32, extra="kv=heads/2")
MLA_NS = Namespace("mla-test", "bfloat16", "vllm-LBHNC", 32, extra="kv=replicated/1")


def caches(heads: int, seed: int | None):
    """One uint8 ``(blocks, heads * head_bytes)`` tensor per layer, as vLLM hands a rank's layers over."""
    g = torch.Generator().manual_seed(seed or 0)
    page = heads * HEAD_BYTES
    ts = [torch.randint(0, 256, (BLOCKS, page), generator=g, dtype=torch.uint8) if seed is not None
          else torch.zeros(BLOCKS, page, dtype=torch.uint8) for _ in range(LAYERS)]
    return vllm_base.CanonicalKVCaches(
        tensors=[vllm_base.CanonicalKVCacheTensor(t, page) for t in ts],
        group_data_refs=[[vllm_base.CanonicalKVCacheRef(i, page) for i in range(LAYERS)]]), ts


def worker(daemon, tp: int, rank: int, seed: int | None, ns=HEADS_NS, replicated: bool = False):
    c, ts = caches(HEADS // tp if not replicated else 1, seed)
    w = KVTierWorker(c, ns, K, daemon.socket, name=f"w-tp{tp}-{rank}",
                     slices=plan(tp, rank, HEADS, replicated, head_major=True))
    return w, ts


def tp1_scheduler(daemon) -> KVTierManager:
    """The scheduler of a TP=1 engine in the head-sliced layout (it asks for every head)."""
    return KVTierManager([TierGroup(0, HEADS_NS, LAYERS * HEAD_BYTES, slices=plan(1, 0, HEADS, False, True))],
                         K, daemon.socket, name="sched")


def run(w, job: int, is_load: bool, keys: list[bytes], ids: list[int], first: int = 0):
    if is_load:
        w.submit_load(job, KVTierSpecs(keys), gpu_spec(ids, first))
    else:
        w.submit_store(job, gpu_spec(ids), KVTierSpecs(keys))
    return finished(w, {job})[job]


def test_every_tp_size_covers_each_head_slice_exactly_once():
    """For TP 1, 2, 4 over 1, 2, 4, 8 KV heads: the writers of each chunk hold
    every slice once, and every rank holds a slice set it can load."""
    for heads, tp in itertools.product((1, 2, 4, 8), (1, 2, 4)):
        ranks = [plan(tp, r, heads, False, True) for r in range(tp)]
        assert len({(p.slices, p.tag()) for p in ranks}) == 1  # one namespace for every rank and TP size
        assert ranks[0].slices == heads
        for key in (bytes([b]) * 16 for b in range(8)):
            written = sorted(s for p in ranks if p.writes(key) for s in range(p.first, p.first + p.count))
            assert written == list(range(heads)), (heads, tp, written)


def test_a_tp1_store_loads_into_both_ranks_of_a_tp2_engine_byte_exactly(daemon):
    one, full = worker(daemon, 1, 0, seed=1)
    r0, got0 = worker(daemon, 2, 0, seed=None)
    r1, got1 = worker(daemon, 2, 1, seed=None)
    keys = [kvtier_key(k) for k in offload_keys(2)]
    try:
        assert run(one, 1, False, keys, [4, 5, 6, 7]).success
        # The request's first block is already computed: blocks 1..3 of the two chunks.
        for w in (r0, r1):
            assert run(w, 2, True, keys, [10, 11, 12], first=1).success
        for h, got in ((0, got0), (1, got1)):
            for f, g in zip(full, got):
                assert torch.equal(g[10:13], f[5:8, h * HEAD_BYTES:(h + 1) * HEAD_BYTES])
                assert not g[:10].any() and not g[13:].any()
    finally:
        for w in (one, r0, r1):
            w.shutdown()


def test_a_tp2_engine_stores_one_copy_that_a_tp1_engine_loads_whole(daemon):
    r0, src0 = worker(daemon, 2, 0, seed=2)
    r1, src1 = worker(daemon, 2, 1, seed=3)
    one, got = worker(daemon, 1, 0, seed=None)
    keys = [kvtier_key(k) for k in offload_keys(2, salt=1)]
    try:
        for w in (r0, r1):
            assert run(w, 1, False, keys, [0, 1, 2, 3]).success
        (ns,) = daemon.stats()["namespaces"]
        assert ns["bytes"] == 2 * K * LAYERS * HEADS * HEAD_BYTES  # one copy: each head once
        assert run(one, 2, True, keys, [8, 9, 10, 11]).success
        # And starting mid-chunk (the engine holds the first block already): blocks 1..3.
        assert run(one, 3, True, keys, [13, 14, 15], first=1).success
        for g, a, b in zip(got, src0, src1):
            assert torch.equal(g[8:12], torch.cat([a[0:4], b[0:4]], dim=1))
            assert torch.equal(g[13:16], torch.cat([a[1:4], b[1:4]], dim=1))
            assert not g[12].any()
    finally:
        for w in (one, r0, r1):
            w.shutdown()


def test_the_scheduler_hits_a_chunk_only_when_every_head_slice_is_in_the_pool(daemon):
    """Rank 1 of a TP=2 engine has not stored yet: a TP=1 engine's lookup
    misses (it could not load head 1). Once rank 1 stored, it hits."""
    r0, _ = worker(daemon, 2, 0, seed=4)
    r1, _ = worker(daemon, 2, 1, seed=5)
    sched = tp1_scheduler(daemon)
    okeys = offload_keys(2, salt=2)
    keys = [kvtier_key(k) for k in okeys]
    try:
        assert run(r0, 1, False, keys, [0, 1, 2, 3]).success
        sched.prefetch("a", okeys)
        assert [sched.lookup(k, req("a")) for k in okeys] == [vllm_base.LookupResult.MISS] * 2
        assert run(r1, 1, False, keys[:1], [0, 1]).success  # head 1 of the first chunk only
        sched.on_schedule_end(None)
        sched.prefetch("b", okeys)
        assert [sched.lookup(k, req("b")) for k in okeys] == [vllm_base.LookupResult.HIT,
                                                             vllm_base.LookupResult.MISS]
    finally:
        sched.shutdown()
        r0.shutdown()
        r1.shutdown()


def test_slice_keys_are_distinct_and_slice_0_is_the_chunks_own_key():
    """Every slice of every chunk has its own key; a rank's held keys are its
    part of ``all_keys``; many chunks at once give what one at a time gives."""
    chunks = [kvtier_key(k) for k in offload_keys(64, salt=9)]
    for heads, tp in itertools.product((1, 2, 4, 8), (1, 2, 4)):
        full = plan(1, 0, heads, False, True)
        flat = full.keys(chunks)
        assert flat == [k for c in chunks for k in full.all_keys(c)]
        assert len(set(flat)) == len(flat) == heads * len(chunks)
        assert flat[::heads] == chunks  # slice 0: a lookup of the chunk keys asks for it
        assert all(slice_key(c, h, heads) == full.all_keys(c)[h] for c in chunks[:4] for h in range(heads))
        for rank in range(tp):
            p = plan(tp, rank, heads, False, True)
            assert p.keys(chunks, held=True) == [k for c in chunks for k in p.held_keys(c)]
            assert p.held_keys(chunks[0]) == full.all_keys(chunks[0])[p.first:p.first + p.count]
    with pytest.raises(ValueError):
        plan(1, 0, 2, False, True).keys([b"short"])


def test_a_miss_asks_for_one_key_per_chunk_and_a_hit_still_needs_every_slice(daemon):
    """On a miss the scheduler's lookup costs the daemon what the per-rank
    layout's does: one lookup of one key (slice 0) per chunk. Only chunks
    whose slice 0 hit are asked for again with all their slices, so a chunk
    missing head 1 is still a miss."""
    r0, _ = worker(daemon, 2, 0, seed=8)
    r1, _ = worker(daemon, 2, 1, seed=9)
    sched = tp1_scheduler(daemon)
    okeys = offload_keys(3, salt=5)
    keys = [kvtier_key(k) for k in okeys]

    def asked():
        # The scheduler's lookups are answered by the lookup mirror (no round trip); its
        # client reports the counts ahead of its next request: ping, then read them.
        for g in sched.groups.values():
            g.client.ping()
        (ns,) = daemon.stats()["namespaces"]
        return ns["lookups"], ns["hits"] + ns["misses"]

    try:
        before = asked()
        sched.prefetch("a", okeys)
        assert [sched.lookup(k, req("a")) for k in okeys[:1]] == [vllm_base.LookupResult.MISS]
        assert asked() == (before[0] + 1, before[1] + 3)
        assert run(r0, 1, False, keys, list(range(6))).success      # head 0 of all three chunks
        assert run(r1, 1, False, keys[:2], list(range(4))).success  # head 1 of the first two
        sched.on_schedule_end(None)
        before = asked()
        sched.prefetch("b", okeys)
        assert [sched.lookup(k, req("b")) for k in okeys] == [vllm_base.LookupResult.HIT] * 2 + [
            vllm_base.LookupResult.MISS]
        assert asked() == (before[0] + 2, before[1] + 3 + 3 * HEADS)
    finally:
        sched.shutdown()
        r0.shutdown()
        r1.shutdown()


def test_replicated_kv_is_stored_once_by_the_ranks_and_loaded_by_each(daemon):
    """MLA: both ranks hold the same latent; each chunk is copied by one of
    them (pool bytes = one copy, not two) and both load it back exactly."""
    r0, src = worker(daemon, 2, 0, seed=6, ns=MLA_NS, replicated=True)
    r1, twin = worker(daemon, 2, 1, seed=6, ns=MLA_NS, replicated=True)
    keys = [kvtier_key(k) for k in offload_keys(8, salt=3)]
    page = HEAD_BYTES  # one "head": the latent row of a block
    try:
        copied = [run(w, 1, False, keys, list(range(K * len(keys)))) for w in (r0, r1)]
        assert all(r.success for r in copied)
        (ns,) = daemon.stats()["namespaces"]
        assert ns["bytes"] == len(keys) * K * LAYERS * page
        # Each chunk was copied by one rank only (not stored twice and deduplicated).
        assert sum(r.transfer_size or 0 for r in copied) == ns["bytes"]
        assert all(r.transfer_size for r in copied), "the writes are spread over both ranks"
        for w, dst in ((r0, src), (r1, twin)):
            for t in dst:
                t.zero_()
            assert run(w, 2, True, keys[:4], list(range(8))).success
        for a, b, orig in zip(src, twin, caches(1, seed=6)[1]):
            assert torch.equal(a[:8], orig[:8]) and torch.equal(b[:8], orig[:8])
    finally:
        r0.shutdown()
        r1.shutdown()


def test_only_head_major_kv_tensors_are_cut_into_head_slices():
    """vLLM's CPU attention layer ``[blocks, heads, tokens, 2 * head_size]`` is;
    a tokens-outside-heads layout, or padded blocks with several heads per
    rank, make the worker fall back to the per-rank layout."""
    from kvtier.integrations.vllm.spec import _heads_outermost
    cpu = torch.zeros(8, 2, 32, 128, dtype=torch.bfloat16)
    assert _heads_outermost(cpu, 2)
    assert not _heads_outermost(cpu.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3), 2)  # tokens outside
    padded = torch.zeros(8, 2 * 32 * 128 + 64, dtype=torch.bfloat16)[:, :2 * 32 * 128].view(8, 2, 32, 128)
    assert not _heads_outermost(padded, 2)
    assert _heads_outermost(torch.zeros(8, 32 * 128 + 64, dtype=torch.bfloat16)[:, :32 * 128].view(8, 1, 32, 128), 1)
    assert not _heads_outermost(cpu, 4)


def test_a_chunk_cut_in_head_slices_is_announced_once_and_removed_when_any_slice_goes():
    """KV events (``events.py``) see chunks, the daemon sees slices: a chunk is
    one BlockStored, and one BlockRemoved when the daemon drops any of its slices."""
    from kvtier.integrations.vllm.events import TierEvents
    from kvtier.integrations.vllm.slices import slice_key

    class Feed:  # the daemon's removals, as DaemonFeed.messages returns them (this engine's tenant)
        gone: list = []

        def messages(self):
            out, Feed.gone = Feed.gone, []
            return [("tenant-a", [("removed", k) for k in out])] if out else []

        def close(self):
            pass

    ev = TierEvents(True, Feed(), plan(1, 0, HEADS, False, True), tenant=lambda: "tenant-a")
    okeys = offload_keys(2, salt=9)
    ev.stored(okeys)
    ev.stored(okeys)
    (stored,) = ev.take()
    assert not stored.removed and stored.keys == okeys
    Feed.gone = [slice_key(kvtier_key(okeys[1]), 1, HEADS), slice_key(kvtier_key(okeys[1]), 0, HEADS)]
    (removed,) = ev.take()
    assert removed.removed and removed.keys == [okeys[1]]
    ev.missing(okeys[:1])
    (removed,) = ev.take()
    assert removed.keys == [okeys[0]] and ev.take() == []


def test_an_mla_chunk_is_no_hit_until_its_one_writer_committed_it_and_then_every_rank_loads_it(daemon_factory):
    """Replicated KV (MLA at TP=2): the scheduler (as rank 0) looks up chunks
    whose single replica a rank is still copying (WRITING in the daemon,
    slow copies here), after the other rank's part of the same store job
    already came back done. Those chunks are misses, not hits a rank could
    fail to load; once the writers committed, every chunk is a hit and both
    ranks load all of them, byte-exact, with no failed load in the daemon."""
    # Slow copies, one kvtier block per copy chunk: a rank's two blocks commit >= 10 s after it
    # starts, so the lookup below comes first even on a loaded CI box (checked after it).
    d = daemon_factory(env={"KVTIER_COPY_DELAY_S": "5", "KVTIER_COPY_CHUNK_BYTES": "4KiB"})
    r0, src = worker(d, 2, 0, seed=7, ns=MLA_NS, replicated=True)
    r1, twin = worker(d, 2, 1, seed=7, ns=MLA_NS, replicated=True)
    sched = KVTierManager([TierGroup(0, MLA_NS, LAYERS * HEAD_BYTES, slices=plan(2, 0, HEADS, True, True))],
                          K, d.socket, name="sched")
    okeys = offload_keys(4, salt=14)
    keys = [kvtier_key(k) for k in okeys]
    ids = list(range(K * len(keys)))

    def namespace():
        (ns,) = d.stats()["namespaces"]
        return ns

    def hits(req_id):
        sched.on_schedule_end(None)
        sched.prefetch(req_id, okeys)
        return [sched.lookup(k, req(req_id)) == vllm_base.LookupResult.HIT for k in okeys]

    try:
        mine = [sum(plan(2, r, HEADS, True, True).writes(k) for k in keys) for r in (0, 1)]
        assert sorted(mine) == [2, 2]  # each rank writes two of the four chunks
        r0.submit_store(1, gpu_spec(ids), KVTierSpecs(keys))
        r1.submit_store(1, gpu_spec(ids), KVTierSpecs(keys))
        assert wait_for(lambda: namespace()["writing"] == len(keys), 30)  # both writers' copies under way
        assert hits("early") == [False] * 4
        assert namespace()["writing"] == len(keys)  # the lookup was answered before any commit
        for w in (r0, r1):
            assert finished(w, {1})[1].success
        assert hits("late") == [True] * 4
        for w, dst in ((r0, src), (r1, twin)):
            for t in dst:
                t.zero_()
            assert run(w, 2, True, keys, ids).success
        for a, b, orig in zip(src, twin, caches(1, seed=7)[1]):
            assert torch.equal(a[:len(ids)], orig[:len(ids)]) and torch.equal(b[:len(ids)], orig[:len(ids)])
        ns = namespace()
        assert (ns["loaded"], ns["load_failed"]) == (2 * len(keys), 0)
    finally:
        sched.shutdown()
        r0.shutdown()
        r1.shutdown()
