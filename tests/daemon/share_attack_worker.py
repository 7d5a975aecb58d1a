"""Engine workers for the tenant-share attacks (issue 30, rows 1-3), run as other Unix users.

``python share_attack_worker.py ROLE SOCKET UID`` prints one JSON line and
exits 0 (it becomes UID once its imports are done, as tenant_worker does).
The pool is 64 MiB of 4 MiB slabs with ``tenant_share = 0.5``:

  victim       stores VICTIM_BLOCKS blocks of 64 KiB (16 MiB, 4 slabs) and looks them up.
  victim-read  looks the victim's hashes up and loads them; hits, loaded, digest.
  classes      16 caches on one connection (``Client.share``), blocks of 256 B,
               512 B, ... 4 KiB: one block stored in each (one slab per size).
  big          one cache of 2 MiB + 256 B blocks: 15 of them stored (a slab each).
  swap         stores its share (512 blocks of 64 KiB), then offloads as many
               bytes of swap (one request of 512 blocks).
  tiny         16,384 blocks of 256 B (4 MiB): every journal record a 64 MiB pool has
               (one per 4 KiB of pool).
  tiny-read    looks those 16,384 hashes up (after a restart).
  small        16 blocks of 16 KiB (tests.helpers' cache); small-read looks them up.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from kvtier.client import Client, Namespace, ShmKVCache  # noqa: E402
from tests.daemon.tenant_worker import become, digest  # noqa: E402
from tests.helpers import NS, make_kv  # noqa: E402

VICTIM_BLOCKS, SWAP_BLOCKS, TINY_BLOCKS, SMALL_BLOCKS = 256, 512, 16384, 16
VICTIM_SHAPE = (VICTIM_BLOCKS, 2, 16, 8, 128)  # one layer, float16: 64 KiB a block


def hashes(tag: int, n: int) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(4, "little") + bytes(11) for i in range(n)]


def ns(model: str) -> Namespace:
    return Namespace(model, "float16", "flashinfer", 16)


def cache(shapes: list[tuple], seed: int) -> ShmKVCache:
    kv = ShmKVCache(shapes, torch.float16)
    g = torch.Generator().manual_seed(seed)
    for t in kv.tensors:
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).half())
    return kv


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def store_all(c: Client, hs: list[bytes], ids: list[int], batch: int = 512) -> int:
    return sum(c.store(hs[i:i + batch], ids[i:i + batch]).wait().done for i in range(0, len(hs), batch))


def charged(c: Client) -> int:
    return sum(row["bytes"] for row in c.stats()["tenants"]["tenants"].values())


def victim(socket: str) -> None:
    kv = cache([VICTIM_SHAPE], seed=11)
    ids = list(range(VICTIM_BLOCKS))
    with Client(socket, name="victim") as c:
        c.register_kv_cache(kv, [0], ns("victim-model"))
        done = store_all(c, hashes(0xA1, VICTIM_BLOCKS), ids)
        say(step="stored", done=done, hits=c.lookup(hashes(0xA1, VICTIM_BLOCKS)), digest=digest(kv, ids))


def victim_read(socket: str) -> None:
    kv = cache([VICTIM_SHAPE], seed=12)
    ids, hs = list(range(VICTIM_BLOCKS)), hashes(0xA1, VICTIM_BLOCKS)
    with Client(socket, name="victim-reader") as c:
        c.register_kv_cache(kv, [0], ns("victim-model"))
        hits = c.lookup(hs)
        loaded = c.load(hs[:hits], ids[:hits]).wait().done if hits else 0
        say(step="read", hits=hits, loaded=loaded, digest=digest(kv, ids))


def classes(socket: str) -> None:
    first = Client(socket, name="classes")
    views, done, kvs = [first] + [first.share() for _ in range(15)], [], []
    for k, view in enumerate(views, start=1):  # blocks of k x 256 B: a size class each
        kv = cache([(1, 2, 1, 1, 64 * k)], seed=k)
        kvs.append(kv)
        view.register_kv_cache(kv, [0], ns(f"class-{k}"))
        done.append(view.store(hashes(0xC0 + k, 1), [0]).wait().done)
    say(step="stored", done=done, charged=charged(first))
    for view in views:
        view.close()


def big(socket: str) -> None:
    kv = cache([(15, 2, 1024, 8, 64), (15, 2, 1, 1, 64)], seed=5)  # 2 MiB + 256 B a block
    with Client(socket, name="big") as c:
        c.register_kv_cache(kv, [0, 0], ns("big-blocks"))
        done = c.store(hashes(0xB1, 15), list(range(15))).wait().done
        say(step="stored", done=done, charged=charged(c))


def swap(socket: str) -> None:
    kv = cache([(SWAP_BLOCKS, 2, 16, 8, 128)], seed=6)
    ids = list(range(SWAP_BLOCKS))
    with Client(socket, name="swapper") as c:
        c.register_kv_cache(kv, [0], ns("swap-model"))
        stored = store_all(c, hashes(0x5A, SWAP_BLOCKS), ids)
        res = c.offload("preempted", ids).wait()
        say(step="swapped", stored=stored, offloaded=res.done, charged=charged(c),
            swap_bytes=c.stats()["swap"]["bytes"])


def tiny(socket: str) -> None:
    kv = cache([(TINY_BLOCKS, 2, 1, 1, 64)], seed=8)  # 256 B a block
    with Client(socket, name="tiny") as c:
        c.register_kv_cache(kv, [0], ns("tiny-blocks"))
        say(step="stored", done=store_all(c, hashes(0x71, TINY_BLOCKS), list(range(TINY_BLOCKS))))


def tiny_read(socket: str) -> None:
    kv = cache([(TINY_BLOCKS, 2, 1, 1, 64)], seed=9)
    with Client(socket, name="tiny-reader") as c:
        c.register_kv_cache(kv, [0], ns("tiny-blocks"))
        hs = hashes(0x71, TINY_BLOCKS)
        say(step="read", hits=sum(c.lookup(hs[i:i + 512]) for i in range(0, TINY_BLOCKS, 512)))


def small(socket: str) -> None:
    kv = make_kv(seed=3)
    with Client(socket, name="small") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        say(step="stored", done=c.store(hashes(0x33, SMALL_BLOCKS), list(range(SMALL_BLOCKS))).wait().done)


def small_read(socket: str) -> None:
    kv = make_kv(seed=4)
    with Client(socket, name="small-reader") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        say(step="read", hits=c.lookup(hashes(0x33, SMALL_BLOCKS)))


ROLES = {"victim": victim, "victim-read": victim_read, "classes": classes, "big": big, "swap": swap,
         "tiny": tiny, "tiny-read": tiny_read, "small": small, "small-read": small_read}

if __name__ == "__main__":
    become(int(sys.argv[3]))
    ROLES[sys.argv[1]](sys.argv[2])
