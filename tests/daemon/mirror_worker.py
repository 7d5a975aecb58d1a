"""An engine for the lookup-mirror multi-user tests, run as another Unix user.

``python mirror_worker.py ROLE SOCKET UID [NAME]`` imports what it needs as
root, becomes UID for good, then prints one JSON line and exits 0:

  engine    registers, stores HASHES, reports whether its client mapped the
            mirror and how many hits it answered there; then tries to write
            the table through the read-only descriptor it was handed (a
            shared writable mapping, a reopen for writing through /proc,
            write(2)) and to open it by name; waits for a line on stdin (the
            stranger's turn) and closes.
  stranger  another tenant: tries to open table NAME by name under /dev/shm,
            to ask the daemon for it before and after registering a cache of
            its own, and to look HASHES up in its own namespace.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvtier.client import Client  # noqa: E402
from kvtier.client.errors import DaemonUnavailable  # noqa: E402
from kvtier.client.handover import fetch_mirror  # noqa: E402
from kvtier.pool import shm_index  # noqa: E402,F401  (imported while root: the reader maps it later)
from kvtier.protocol.arrays import pack_hashes  # noqa: E402
from tests.helpers import NS, make_kv  # noqa: E402
from tests.privileges import drop_to  # noqa: E402

HASHES = [hashlib.blake2b(bytes([0x33, i]), digest_size=16).digest() for i in range(6)]


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def refused(fn) -> str:
    """'ok' if ``fn`` worked, else the errno name (or exception class) that stopped it."""
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, type(exc).__name__) if exc.errno else type(exc).__name__
    except (DaemonUnavailable, ValueError) as exc:
        return type(exc).__name__


def engine(socket: str) -> None:
    kv = make_kv(seed=21)
    with Client(socket, name="engine", heartbeat=False) as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(HASHES[:4], [0, 1, 2, 3]).wait().ok
        name = c.registration.index
        mapped = c._mirror is not None
        mirror_hits = c._mirror.ready_prefix(pack_hashes(HASHES)) if mapped else None
        hits = c.lookup(HASHES)
        c.ping()  # reports the mirror's lookup
        fd = fetch_mirror(socket, name)
        size = os.fstat(fd).st_size
        out = {
            "by_name": refused(lambda: os.close(os.open("/dev/shm/" + name.lstrip("/"), os.O_RDONLY))),
            "map_shared_write": refused(lambda: mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                                                          prot=mmap.PROT_READ | mmap.PROT_WRITE).close()),
            "reopen_for_writing": refused(lambda: os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDWR))),
            "write": refused(lambda: os.pwrite(fd, b"\xff" * 8, 0)),
            "truncate": refused(lambda: os.ftruncate(fd, 0)),
        }
        os.close(fd)
        say(step="engine", name=name, mapped=mapped, mirror_hits=mirror_hits, hits=hits,
            mirror_lookups=c.stats()["namespaces"][0]["mirror_lookups"], **out)
        sys.stdin.readline()  # the stranger tries now, while this registration is live
        after = c._mirror.ready_prefix(pack_hashes(HASHES)) if mapped else None
        say(step="after", mirror_hits=after)
    kv.close()


def stranger(socket: str, name: str) -> None:
    out = {"by_name": refused(lambda: os.close(os.open("/dev/shm/" + name.lstrip("/"), os.O_RDONLY))),
           "asked_unregistered": refused(lambda: os.close(fetch_mirror(socket, name)))}
    kv = make_kv(seed=22)
    with Client(socket, name="stranger", heartbeat=False) as c:
        c.register_kv_cache(kv, [0] * 4, NS)  # the same fingerprint: its own tenant's namespace
        out["asked_registered"] = refused(lambda: os.close(fetch_mirror(socket, name)))
        out["own_mirror"] = c.registration.index
        out["own_mapped"] = c._mirror is not None
        out["hits"] = c.lookup(HASHES)
    kv.close()
    say(step="stranger", **out)


def become(uid: int) -> None:
    import numpy  # noqa: F401  everything loaded while still root
    import posix_ipc  # noqa: F401
    import torch  # noqa: F401
    import zmq  # noqa: F401
    from kvtier.pool import segment  # noqa: F401
    from kvtier.transfer import shm  # noqa: F401
    drop_to(uid)


if __name__ == "__main__":
    become(int(sys.argv[3]))
    if sys.argv[1] == "engine":
        engine(sys.argv[2])
    else:
        stranger(sys.argv[2], sys.argv[4])
