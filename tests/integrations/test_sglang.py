"""SGLang's HiCache storage on kvtier: SGLang's real host KV pools and its
storage-backend factory, a real daemon, pages moved between processes.

Each "engine" is a process of its own that builds SGLang's own host pool
class (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` on CPU), loads the
backend the way SGLang does (``StorageBackendFactory.create_backend("dynamic",
...)`` naming module and class, then ``register_mem_pool_host``), and calls
the ``HiCacheStorage`` methods SGLang's cache controller calls.

SGLang's model-config package imports torchvision (for multimodal
preprocessing) when the host pool module is imported; PyPI has no torchvision
that imports next to a CPU torch, so where the real one does not import a
stand-in module with the two names that import reads is put in its place.
Nothing here calls it. The naming tests need no SGLang.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from kvtier.integrations.sglang.naming import PageIdentity, Settings, page_key

L, H, D, PAGE, DEVICE_TOKENS = 2, 2, 8, 4, 64
BACKEND = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
           "class_name": "KVTierHiCacheStorage", "interface_v1": 1}


def _import_sglang() -> str:
    """"" when SGLang's host pools and storage interfaces import, else why not."""
    import importlib.util
    if importlib.util.find_spec("sglang") is None:  # no stand-in where SGLang is absent: other tests share the process
        return "sglang is not installed"
    try:
        import torchvision  # noqa: F401
    except Exception:
        try:
            import transformers  # noqa: F401  (its own torchvision probe must see none)
        except Exception as exc:
            return f"transformers does not import: {exc}"
        _torchvision_stand_in()
    try:
        import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
        import sglang.srt.mem_cache.pool_host.mla  # noqa: F401
        import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
    except Exception as exc:
        return f"sglang's host pool or storage modules do not import: {type(exc).__name__}: {exc}"
    return ""


def _torchvision_stand_in() -> None:
    import enum
    import importlib.machinery
    import sys
    import types

    class InterpolationMode(enum.Enum):
        NEAREST, BILINEAR, BICUBIC = "nearest", "bilinear", "bicubic"

    mods = {n: types.ModuleType(n) for n in ("torchvision", "torchvision.transforms",
                                              "torchvision.transforms.functional")}
    for m in mods.values():
        m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None)
    mods["torchvision"].transforms = mods["torchvision.transforms"]
    mods["torchvision.transforms"].functional = mods["torchvision.transforms.functional"]
    mods["torchvision.transforms"].InterpolationMode = InterpolationMode
    mods["torchvision.transforms.functional"].InterpolationMode = InterpolationMode
    sys.modules.update(mods)


@pytest.fixture(scope="module")
def sglang():
    why = _import_sglang()
    if why:
        pytest.skip(f"SGLang is not importable here ({why}); see README 'Using kvtier with SGLang'")


# ---- an SGLang rank, in this process or another ---------------------------------------------
def host_pool(mla: bool, layout: str):
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    # SGLang keeps 10 GiB of the machine's free memory out of its host pools; these are KiB.
    with host_memory_budget_scope(1 << 30):
        return _host_pool(mla, layout, MHATokenToKVPoolHost, MLATokenToKVPoolHost)


def _host_pool(mla, layout, MHATokenToKVPoolHost, MLATokenToKVPoolHost):
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
    cpu, dt = torch.device("cpu"), torch.float16
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    common = dict(pin_memory=False, device="cpu", device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=L)
    if mla:
        rows = tuple(torch.zeros(DEVICE_TOKENS, 1, 24, dtype=dt) for _ in range(L))
        info = MLABufferInfo(buffers=rows, data_ptrs=ptrs(rows), layer_indices=tuple(range(L)), device_layer_num=L,
                             page_size=PAGE, kv_lora_rank=16, qk_rope_head_dim=8, kv_cache_dim=24, dtype=dt,
                             device=cpu)
        return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, target_layer_num=L, **common)
    k = tuple(torch.zeros(DEVICE_TOKENS, H, D, dtype=dt) for _ in range(L))
    v = tuple(torch.zeros(DEVICE_TOKENS, H, D, dtype=dt) for _ in range(L))
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=PAGE, head_num=H, head_dim=D, v_head_dim=D, dtype=dt, device=cpu)
    return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, **common)


def backend(socket: str, pool, mla=False, tp_rank=0, tp_size=1, model="org/tiny@r1", **extra):
    """The backend as SGLang's cache controller attaches it."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    config = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                  attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                  is_page_first_layout=False, model_name=model,
                                  extra_config={**BACKEND, "kvtier_socket": socket, **extra})
    b = StorageBackendFactory.create_backend("dynamic", config, pool)
    b.register_mem_pool_host(pool)
    b.on_host_pools_registered()
    return b


def connected(b) -> None:
    """Wait until the backend's client is connected (a readiness probe)."""
    import time
    deadline = time.monotonic() + 60
    while not b.client.connected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b.client.connected


def pages(pool, starts):
    return [pool.get_data_page(s, flat=True).clone() for s in starts]


def _engine(socket, role, keys, mla, layout, tp_rank, tp_size, seed, out):
    """One SGLang rank process. ``write``: fill host pages with random bytes and
    back them up; ``read``: ask which keys exist, prefetch them into other slots."""
    _import_sglang()
    import torch
    pool = host_pool(mla, layout)
    b = backend(socket, pool, mla=mla, tp_rank=tp_rank, tp_size=tp_size)
    connected(b)  # a busy machine can answer the first HELLO after the backend stopped waiting for it
    n = len(keys)
    idx = pool.alloc(n * PAGE)
    if role == "write":
        g = torch.Generator().manual_seed(seed)
        for s in idx[::PAGE].tolist():
            pool.set_from_flat_data_page(s, torch.randn(pool.get_data_page(s).numel(), generator=g).half())
        result = {"set": b.batch_set_v1(keys, idx)}
    else:
        pool.alloc(3 * PAGE)  # land in other slots than the writer's
        idx = pool.alloc(n * PAGE)
        result = {"exists": b.batch_exists(keys), "get": b.batch_get_v1(keys, idx)}
    result["pages"] = pages(pool, idx[::PAGE].tolist())
    b.close()
    torch.save(result, out)


def _ranks():
    """Rank processes fork from a fork server that imported SGLang once
    (sglang_preload.py); the server itself starts clean, with no thread of
    this process's clients or daemons, like a spawned process."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.integrations.sglang_preload"])
    return ctx


def run_engine(tmp_path, name, *args):
    out = str(tmp_path / f"{name}.pt")
    p = _ranks().Process(target=_engine, args=(*args, out))
    p.start()
    p.join(900)  # a hang guard: SGLang's import alone took over a minute at load average 15-30
    if p.exitcode is None:
        p.kill()
    assert p.exitcode == 0, f"engine {name} exited {p.exitcode}"
    import torch
    return torch.load(out)


KEYS = [f"{i:064x}" for i in range(1, 7)]  # SGLang's page keys: chained sha256 hex digests


# ---- two SGLang processes, one pool --------------------------------------------------------
@pytest.mark.parametrize("mla,layout", [(False, "layer_first"), (False, "page_first"), (True, "layer_first"),
                                        (True, "page_first_direct")])
def test_a_prefix_one_sglang_process_wrote_is_loaded_byte_exact_by_another(sglang, daemon, tmp_path, mla, layout):
    """Engine A backs six pages up; engine B, another process with its own host
    pool, finds all six and prefetches them into different slots: same bytes.
    For MLA, B is TP rank 1 of 2 (MLA's latent KV is the same on every rank)."""
    a = run_engine(tmp_path, "a", daemon.socket, "write", KEYS, mla, layout, 0, 1, 7)
    assert a["set"] == [True] * 6
    b = run_engine(tmp_path, "b", daemon.socket, "read", KEYS, mla, layout, 1 if mla else 0, 2 if mla else 1, 0)
    assert b["exists"] == 6 and b["get"] == [True] * 6
    for pa, pb in zip(a["pages"], b["pages"]):
        assert bytes(pa.view(-1).numpy().tobytes()) == bytes(pb.view(-1).numpy().tobytes())
        assert pa.abs().sum() > 0


def test_mha_pages_are_per_tp_rank_and_a_miss_is_only_a_miss(sglang, daemon, tmp_path):
    """Rank 0's MHA pages hold rank 0's heads: rank 1 of the same model misses
    them - 0 existing, every get False, its host pages untouched, no error."""
    run_engine(tmp_path, "a", daemon.socket, "write", KEYS, False, "layer_first", 0, 2, 7)
    b = run_engine(tmp_path, "b", daemon.socket, "read", KEYS, False, "layer_first", 1, 2, 0)
    assert b["exists"] == 0 and b["get"] == [False] * 6
    assert all(p.abs().sum() == 0 for p in b["pages"])


# ---- in one process: misses, no daemon, hostile input --------------------------------------
def test_with_no_daemon_sglang_gets_misses_and_no_exception_then_connects(sglang, tmp_path, daemon_factory):
    """No daemon at the socket: the backend is built, every call answers a miss
    or a failure at once; once a daemon starts there it connects and stores."""
    socket = str(tmp_path / "later.sock")
    pool = host_pool(False, "layer_first")
    b = backend(socket, pool)
    idx = pool.alloc(2 * PAGE)
    assert b.batch_exists(KEYS[:2]) == 0
    assert b.batch_set_v1(KEYS[:2], idx) == [False, False]
    assert b.batch_get_v1(KEYS[:2], idx) == [False, False]
    assert b.batch_set(KEYS[:1], [pool.get_data_page(0)]) is False and b.get(KEYS[0], pool.get_dummy_flat_data_page()) is None
    daemon_factory(socket=socket)
    connected(b)
    assert b.batch_set_v1(KEYS[:2], idx) == [True, True] and b.batch_exists(KEYS[:2]) == 2
    b.close()


def test_the_page_tensor_interface_round_trips_without_interface_v1(sglang, daemon):
    """SGLang's default calls (a page tensor per key) store and load the same bytes."""
    import torch
    pool = host_pool(False, "page_first")
    b = backend(daemon.socket, pool)
    connected(b)
    page = torch.randn(pool.get_dummy_flat_data_page().numel()).half()
    assert b.set("k1", page) and b.exists("k1") and not b.exists("k2")
    got = b.batch_get(["k1", "k2"], [pool.get_dummy_flat_data_page(), pool.get_dummy_flat_data_page()])
    assert torch.equal(got[0], page) and got[1] is None
    b.close()


def test_hostile_calls_get_failures_never_exceptions(sglang, daemon):
    """Wrong slot counts, slots past the pool, float indices, non-string keys,
    wrong-size page tensors, SGLang's per-pool calls: False / 0 / None."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    pool = host_pool(False, "layer_first")
    b = backend(daemon.socket, pool)
    connected(b)
    idx = pool.alloc(2 * PAGE)
    assert b.batch_set_v1(KEYS[:2], idx[:PAGE]) == [False, False]
    assert b.batch_set_v1(KEYS[:1], torch.arange(pool.size, pool.size + PAGE)) == [False]
    assert b.batch_get_v1(KEYS[:1], idx[:PAGE].float()) == [False]
    assert b.batch_set_v1([1, 2], idx) == [False, False] and b.batch_exists([None]) == 0
    assert b.batch_set(["k"], [torch.zeros(3)]) is False and b.batch_get(["k"], [torch.zeros(3)]) == [None]
    t = PoolTransfer(name=PoolName.MAMBA, keys=["k"], host_indices=idx[:PAGE])
    assert b.batch_exists_v2(["k"], [t]).kv_hit_pages == 0 and b.batch_get_v2([t]) == {PoolName.MAMBA: [False]}
    b.clear()  # never flushes the shared pool
    b.close()


def test_bad_settings_are_refused_naming_the_key(sglang, daemon):
    pool = host_pool(False, "layer_first")
    for bad in ({"kvtier_staging_mib": 0}, {"kvtier_staging_mib": "64"}, {"kvtier_socet": "/x"},
                {"kvtier_timeout_s": -1}, {"kvtier_model_revision": "a|b"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            backend(daemon.socket, pool, **bad)
    with pytest.raises(ValueError, match="names no model"):
        backend(daemon.socket, host_pool(False, "layer_first"), model=None)


# ---- naming (no SGLang needed) -------------------------------------------------------------
def test_page_keys_are_deterministic_16_bytes_and_differ_per_page():
    assert page_key("ab" * 32) == page_key("ab" * 32) and len(page_key("x")) == 16
    assert page_key("a") != page_key("b")
    with pytest.raises(TypeError):
        page_key(b"bytes")


def test_namespaces_mla_shared_by_every_tp_rank_mha_per_rank():
    def ident(**kw):
        base = dict(model="m", revision="r1", dtype="float16", mla=False, layout="layer_first", page_size=64,
                    page_shape=(2, 4, 64, 8, 128), tp_rank=0, tp_size=2)
        return PageIdentity(**{**base, **kw})
    assert ident(mla=True).namespace() == ident(mla=True, tp_rank=1).namespace() == ident(mla=True, tp_size=1).namespace()
    assert ident().namespace() != ident(tp_rank=1).namespace()
    assert ident().namespace() != ident(layout="page_first").namespace()
    assert ident(pp_size=2).namespace() != ident(pp_size=2, pp_rank=1).namespace()
    assert ident(mla=True, dcp_size=2).namespace() != ident(mla=True, dcp_size=2, dcp_rank=1).namespace()
    with pytest.raises(ValueError):
        ident(model="")


def test_settings_defaults_and_token_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVTIER_TOKEN", "t0k")
    s = Settings.parse({**BACKEND})
    assert s.staging_mib == 64 and s.token == "t0k" and s.socket is None
    assert Settings.parse({"kvtier_token": "mine"}).token == "mine"
    assert os.environ["KVTIER_TOKEN"] == "t0k"
