"""An engine worker for the multi-user tests, run as another Unix user.

``python tenant_worker.py ROLE SOCKET [UID]`` prints one JSON line per step
and exits 0; the test reads the lines. With UID (the test runs as root) the
worker imports what it needs, then becomes that user for good
(``setresgid``/``setresuid``) before it touches the daemon: the interpreter
may live where other users cannot read. Roles:

  victim    stores VICTIM_HASHES from a seeded cache, says "stored", waits for
            a line on stdin, then checks its own memory was not touched and
            that loading its hashes gives back exactly its bytes.
  attacker  another user: same fingerprint, same hashes; reports what it could
            see, load, flush and forge.
  reader    looks the victim's hashes up and loads them; reports the bytes' digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvtier.client import Client, KVTierError  # noqa: E402
from kvtier.protocol import messages as m  # noqa: E402
from tests.helpers import NS, block_bytes, make_kv  # noqa: E402
from tests.privileges import drop_to  # noqa: E402

VICTIM_HASHES = [bytes([0x5A, i]) * 8 for i in range(4)]
VICTIM_SEED, FORGED_SEED = 1234, 666


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def digest(kv, ids) -> str:
    h = hashlib.sha256()
    for t in block_bytes(kv, ids):
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def victim(socket: str) -> None:
    kv = make_kv(seed=VICTIM_SEED)
    with Client(socket, name="victim") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(VICTIM_HASHES, [0, 1, 2, 3]).wait().ok
        mine = digest(kv, [0, 1, 2, 3])
        say(step="stored", digest=mine)
        sys.stdin.readline()  # the attack happens now
        untouched = digest(kv, [0, 1, 2, 3]) == mine
        for t in kv.tensors:
            t[4:8].fill_(0)
        res = c.load(VICTIM_HASHES, [4, 5, 6, 7]).wait()
        say(step="checked", untouched=untouched, loaded=res.done, same=digest(kv, [4, 5, 6, 7]) == mine)


def attacker(socket: str) -> None:
    kv = make_kv(seed=FORGED_SEED)
    forged = digest(kv, [0, 1, 2, 3])
    out = {"step": "attacked"}
    with Client(socket, name="attacker") as c:
        s = c.stats()
        out["sees_namespaces"] = [n["fingerprint"] for n in s["namespaces"]]
        out["sees_clients"] = sorted({r["name"] for r in s["clients"]})
        try:
            c.flush()
            out["flush_all"] = "ok"
        except KVTierError as exc:
            out["flush_all"] = exc.code.name
        try:
            out["flush_ns"] = c.flush(NS)
        except KVTierError as exc:
            out["flush_ns"] = exc.code.name
        c.register_kv_cache(kv, [0] * 4, NS)  # the victim's fingerprint, as if it were ours
        out["hits"] = c.lookup(VICTIM_HASHES)
        for t in kv.tensors:
            t[8:12].fill_(0)
        res = c.load(VICTIM_HASHES, [8, 9, 10, 11]).wait()
        out["loaded"] = res.done
        out["got_zeros_only"] = all(not t[8:12].any() for t in kv.tensors)
        # Poisoning: forged blocks under the victim's hashes.
        out["forged_stored"] = c.store(VICTIM_HASHES, [0, 1, 2, 3]).wait().done
        # The confused deputy: memory by name is no longer a thing.
        try:
            c.channel.call(m.Register("x", [{"kind": "shm", "seg": "/kvtier-kv.1.0.x", "offset": 0,
                                              "dtype": "uint8", "shape": [4], "stride": [1],
                                              "block_dim": 0}]))
            out["by_name"] = "registered"
        except KVTierError as exc:
            out["by_name"] = exc.code.name
    # The pool itself: root's segment, closed to other users.
    pools = [n for n in os.listdir("/dev/shm") if n.startswith("kvtier-pool.")]
    opened = []
    for n in pools:
        try:
            os.close(os.open("/dev/shm/" + n, os.O_RDONLY))
            opened.append(n)
        except PermissionError:
            pass
    out["pools_opened"] = opened
    out["forged_digest"] = forged
    say(**out)


def reader(socket: str) -> None:
    kv = make_kv(seed=99)
    with Client(socket, name="reader") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        hits = c.lookup(VICTIM_HASHES)
        res = c.load(VICTIM_HASHES, [0, 1, 2, 3]).wait()
        say(step="read", hits=hits, loaded=res.done, digest=digest(kv, [0, 1, 2, 3]))


def become(uid: int) -> None:
    import torch  # noqa: F401  everything loaded while still root
    import zmq  # noqa: F401
    from kvtier.client import handover  # noqa: F401
    from kvtier.transfer import shm  # noqa: F401
    drop_to(uid)


if __name__ == "__main__":
    if len(sys.argv) > 3:
        become(int(sys.argv[3]))
    {"victim": victim, "attacker": attacker, "reader": reader}[sys.argv[1]](sys.argv[2])
