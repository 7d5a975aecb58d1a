# Feeds BENCHMARKS.md section 8.5 (vLLM 0.33 and SGLang: what a miss and an absent daemon cost).
"""What kvtier's HiCache backend costs SGLang's cache controller per call on a miss.

    .venv-sglang/bin/python scripts/bench_sglang.py                  # the section 8.5 table (~1-2 min)
    .venv-sglang/bin/python scripts/bench_sglang.py --rounds 2 --calls 5   # a smoke run (tests/e2e)

No SGLang engine runs on this machine (its CPU backend wants AMX), so this
times the calls SGLang's cache controller makes, on SGLang's own host KV pool
(``MHATokenToKVPoolHost``) with the backends built by SGLang's own
``StorageBackendFactory``, in one process:

* ``file``       - SGLang's built-in ``HiCacheFile`` on an empty temporary
  directory: the baseline every ratio is against;
* ``kvtier``     - kvtier's backend, daemon up and its pool empty: every key misses;
* ``no daemon``  - kvtier's backend with no daemon at its socket.

Calls, each on ``--pages`` fresh page keys (SGLang's chained sha256 hex):

* ``batch_exists`` - the prefetch's lookup. SGLang's controller stops a
  prefetch at the first missing page, so on a miss this is the only call;
* ``batch_get_v1`` (kvtier, SGLang's zero-copy path with ``interface_v1``)
  and ``batch_get`` (page tensors, the path SGLang takes for ``file``, which
  has no ``batch_get_v1``): reached on a miss only when a page went between
  the lookup and the get. Target pages are allocated outside the timing, as
  the controller does.

Each round runs ``--calls`` calls of one kind per backend, the backends in a
rotating order (A,B,C / B,C,A / ...), so background load hits each alike.
SGLang's per-page "failed to retrieve" warnings are silenced on every backend
(``HiCacheFile.get`` logs one per missing key; kvtier's logs once): the
baseline pays no logging either. Output: p50 / p99 microseconds per call and
the p50 ratio against ``file``; the load average before and after.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import tempfile
import time

from benchlib import REPO, add_json_flag, emit, median, pct, start_daemon, stop_daemon, table

sys.path.insert(0, REPO)
from tests.integrations.test_sglang import BACKEND, _import_sglang  # noqa: E402  (the torchvision stand-in)

BACKENDS = ("file", "kvtier", "no daemon")


def host_pool(pages: int, page: int, layers: int, heads: int, head_dim: int):
    """SGLang's MHA host pool on CPU with room for ``pages`` pages in flight twice over."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    tokens, dt = pages * page, torch.float16
    k = tuple(torch.zeros(tokens, heads, head_dim, dtype=dt) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, head_dim, dtype=dt) for _ in range(layers))
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dt,
                         device=torch.device("cpu"))
    with host_memory_budget_scope(1 << 30):  # SGLang keeps 10 GiB of free memory out of host pools otherwise
        return MHATokenToKVPoolHost(info, 2.0, 0, page, "layer_first", pin_memory=False, device="cpu",
                                    device_capacity_tokens=tokens, start_layer=0, end_layer=layers)


def make_backend(kind: str, pool, socket: str, file_dir: str):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    extra = {"file_storage_path": file_dir} if kind == "file" else {**BACKEND, "kvtier_socket": socket}
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name="org/tiny@r1", extra_config=extra)
    b = StorageBackendFactory.create_backend("file" if kind == "file" else "dynamic", config, pool)
    b.register_mem_pool_host(pool)
    b.on_host_pools_registered()
    return b


def calls(kind: str, b, pool, pages: int) -> dict:
    """The calls timed for one backend: name -> (setup() -> args, fn(args))."""
    idx = pool.alloc(pages * pool.page_size)
    keys = lambda: [secrets.token_hex(32) for _ in range(pages)]  # noqa: E731
    out = {"batch_exists": (keys, lambda ks: b.batch_exists(ks))}
    if kind != "file":  # HiCacheFile has no batch_get_v1 (SGLang uses batch_get for it)
        out["batch_get_v1"] = (keys, lambda ks: b.batch_get_v1(ks, idx))
    out["batch_get"] = (lambda: (keys(), [pool.get_dummy_flat_data_page() for _ in range(pages)]),
                        lambda a: b.batch_get(*a))
    return out


def time_calls(setup, fn, n: int, expect_miss) -> list[float]:
    xs = []
    for _ in range(n):
        arg = setup()
        t = time.perf_counter_ns()
        got = fn(arg)
        xs.append((time.perf_counter_ns() - t) / 1e3)
        if not expect_miss(got):
            raise AssertionError(f"a call that must miss answered {got!r}")
    return xs


def is_miss(got) -> bool:
    if isinstance(got, int):
        return got == 0
    return not any(g is not None and g is not False for g in got)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=64, help="page keys per call (default %(default)s)")
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=50, help="calls of one kind per backend per round")
    add_json_flag(ap)
    args = ap.parse_args(argv)
    why = _import_sglang()
    if why:
        print(f"SGLang is not importable here: {why}", file=sys.stderr)
        return 2
    logging.getLogger("sglang").setLevel(logging.ERROR)
    logging.getLogger("kvtier").setLevel(logging.ERROR)
    import sglang
    import torch
    with tempfile.TemporaryDirectory() as tmp:
        socket = os.path.join(tmp, "kvtier.sock")
        daemon = start_daemon(socket, "256MiB")
        try:
            report = measure(args, socket, tmp)
        finally:
            stop_daemon(daemon)
    report["versions"] = {"sglang": sglang.__version__, "torch": torch.__version__}
    emit(report, report.pop("_tables"), args.json)
    return 0


def measure(args, socket: str, tmp: str) -> dict:
    pool = host_pool(args.pages, args.page_tokens, args.layers, args.heads, args.head_dim)
    backends = {"file": make_backend("file", pool, socket, os.path.join(tmp, "hicache")),
                "kvtier": make_backend("kvtier", pool, socket, ""),
                "no daemon": make_backend("no daemon", pool, os.path.join(tmp, "absent.sock"), "")}
    deadline = time.monotonic() + 60
    while not backends["kvtier"].client.connected and time.monotonic() < deadline:
        time.sleep(0.05)  # a readiness probe: the backend connects in the background
    if not backends["kvtier"].client.connected:
        raise RuntimeError("kvtier's backend did not connect to the daemon in 60 s")
    plans = {k: calls(k, b, pool, args.pages) for k, b in backends.items()}
    for k, plan in plans.items():  # warm every path once, untimed
        for setup, fn in plan.values():
            time_calls(setup, fn, 3, is_miss)
    times: dict[tuple[str, str], list[float]] = {}
    load0 = os.getloadavg()
    for r in range(args.rounds):
        order = BACKENDS[r % 3:] + BACKENDS[:r % 3]
        for call in ("batch_exists", "batch_get_v1", "batch_get"):
            for k in order:
                if call in plans[k]:
                    times.setdefault((call, k), []).extend(time_calls(*plans[k][call], args.calls, is_miss))
    load1 = os.getloadavg()
    for b in backends.values():
        getattr(b, "close", lambda: None)()  # HiCacheFile has no close
    base = {c: median(times[(c, "file")]) for c in ("batch_exists", "batch_get")}
    rows = []
    for (call, k), xs in times.items():
        ref = base.get(call, base["batch_get"])  # batch_get_v1 against file's batch_get (its path in SGLang)
        rows.append([call, k, len(xs), round(median(xs), 1), round(pct(xs, 99), 1), round(median(xs) / ref, 2)])
    headers = ["call", "backend", "calls", "p50 us", "p99 us", "p50 / file's"]
    title = (f"{args.pages} page keys per call, every one a miss; pages of {args.page_tokens} tokens x "
             f"{args.layers} layers x {args.heads} heads x {args.head_dim} (float16); {args.rounds} rounds x "
             f"{args.calls} calls, backends rotating; load average {load0[0]:.1f} -> {load1[0]:.1f}")
    return {"load": [load0, load1], "rows": [dict(zip(headers, r)) for r in rows],
            "us": {f"{c}/{k}": xs for (c, k), xs in times.items()}, "_tables": [table(headers, rows, title)]}


if __name__ == "__main__":
    sys.exit(main())
