"""An engine of another Unix user for the disk-tier trust tests.

``python disk_worker.py ROLE SOCKET UID TAG N`` drops to UID once its imports
are done (as ``tenant_worker.py`` does), prints one JSON line and exits 0:

  store  stores N blocks (a seeded cache of N engine blocks) under chain TAG;
         reports what the store said and the digest of the bytes
  read   looks chain TAG up and loads it into a zeroed cache; reports the
         hits, the blocks loaded and the digest of the bytes it got
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvtier.client import Client  # noqa: E402
from tests.daemon.tenant_worker import digest  # noqa: E402
from tests.helpers import NS, SHAPE, make_kv  # noqa: E402
from tests.privileges import drop_to  # noqa: E402


def chain(tag: int, n: int) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(4, "little") + bytes(11) for i in range(n)]


def main(role: str, socket: str, uid: int, tag: int, n: int) -> None:
    kv = make_kv(shape=(n, *SHAPE[1:]), seed=1000 + tag)
    hs = chain(tag, n)
    drop_to(uid)
    with Client(socket, name=f"{role}-{uid}", timeout=10.0, transfer_timeout=60.0) as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        if role == "store":
            r = c.store(hs, list(range(n))).wait()
            out = {"done": r.done, "failed": len(r.failed), "digest": digest(kv, range(n))}
        else:
            for t in kv.tensors:
                t.zero_()
            hits = c.lookup(hs)
            r = c.load(hs[:hits], list(range(hits))).wait() if hits else None
            out = {"hits": hits, "loaded": r.done if r else 0, "digest": digest(kv, range(n))}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
