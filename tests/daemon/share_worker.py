"""An engine worker for the tenant-share tests, run as another Unix user.

``python share_worker.py ROLE SOCKET UID`` prints one JSON line and exits 0
(the worker becomes UID once its imports are done, as tenant_worker does):

  owner   stores OWNER_BLOCKS blocks of a seeded cache under its hashes.
  flood   stores FLOOD_ROUNDS x FLOOD_BLOCKS new blocks, one store per round,
          then looks up its last round; reports what each store kept and
          whose rows its status shows.
  reader  looks the owner's hashes up and loads them into other slots;
          reports the hits and the digest of the bytes it got.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvtier.client import Client  # noqa: E402
from tests.daemon.tenant_worker import become, digest  # noqa: E402
from tests.helpers import NS, make_kv  # noqa: E402

OWNER_BLOCKS, FLOOD_BLOCKS, FLOOD_ROUNDS = 24, 30, 10
OWNER_HASHES = [bytes([0x0A, i]) * 8 for i in range(OWNER_BLOCKS)]
OWNER_SEED = 4321


def flood_hashes(r: int) -> list[bytes]:
    return [bytes([0xF1, r, i]) + bytes(13) for i in range(FLOOD_BLOCKS)]


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def settled(c) -> None:
    """With a disk tier: wait until the blocks stored so far are written (a store
    while the small write-behind queue is full is not written at all)."""
    deadline = time.monotonic() + 20
    while c.stats()["disk"].get("queued_bytes") and time.monotonic() < deadline:
        time.sleep(0.02)


def owner(socket: str) -> None:
    kv = make_kv(seed=OWNER_SEED)
    ids = list(range(OWNER_BLOCKS))
    with Client(socket, name="owner") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        done = 0
        for i in range(0, OWNER_BLOCKS, 8):  # 8 at a time: each fits the write-behind queue
            done += c.store(OWNER_HASHES[i:i + 8], ids[i:i + 8]).wait().done
            settled(c)
        say(step="stored", done=done, digest=digest(kv, ids))


def flood(socket: str) -> None:
    kv = make_kv(seed=7)
    with Client(socket, name="flood") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        kept = []
        for r in range(FLOOD_ROUNDS):
            kept.append(c.store(flood_hashes(r), list(range(FLOOD_BLOCKS))).wait().done)
            settled(c)
        say(step="flooded", kept=kept, last_hits=c.lookup(flood_hashes(FLOOD_ROUNDS - 1)),
            sees_tenants=sorted(c.stats()["tenants"]["tenants"]))


def reader(socket: str) -> None:
    kv = make_kv(seed=99)
    slots = list(range(32 - OWNER_BLOCKS, 32))  # other slots than the owner used: bytes land where asked
    with Client(socket, name="reader") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        hits = c.lookup(OWNER_HASHES)
        res = c.load(OWNER_HASHES[:hits], slots[:hits]).wait() if hits else None
        say(step="read", hits=hits, loaded=res.done if res else 0, digest=digest(kv, slots))


if __name__ == "__main__":
    become(int(sys.argv[3]))
    {"owner": owner, "flood": flood, "reader": reader}[sys.argv[1]](sys.argv[2])
