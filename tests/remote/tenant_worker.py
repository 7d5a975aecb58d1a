"""An engine worker for the remote-tier tenant tests, run as another Unix user.

``python tenant_worker.py ROLE SOCKET UID ARG`` becomes UID once its imports
are done (tests/privileges.py), registers a cache, prints {"step": "ready"},
waits for a line on stdin (the test stops the store meanwhile), does its
part and prints one JSON line:

  flood   ARG = N: sends N lookups of chains the node lacks and N loads of
          blocks it lacks, all at once without waiting (pipelined on one
          connection), then collects every answer: each lookup asks the remote
          tier (a probe), each load waits for a fetch.
  victim  ARG = the first token of its 12-block prompt: one lookup, then a load
          of the hits; reports the hits, the blocks loaded and their digest.
  stats   reports the ``remote`` section of its stats.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvtier.client import Client, block_hashes  # noqa: E402
from kvtier.protocol import messages as m  # noqa: E402
from kvtier.protocol.arrays import pack_hashes  # noqa: E402
from tests.helpers import NS, make_kv  # noqa: E402
from tests.privileges import drop_to  # noqa: E402


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def digest(kv, ids) -> str:
    """sha256 of the blocks' bytes in tests/remote/test_two_nodes.engine_blocks order."""
    return hashlib.sha256(b"".join(t[i].clone().numpy().tobytes() for i in ids for t in kv.tensors)).hexdigest()


def flood(c: Client, n: int) -> None:
    channel, reg = c.connection.channel, c.registration.reg
    chains = [block_hashes(list(range(3_000_000 + 1000 * i, 3_000_000 + 1000 * i + 64)), 16) for i in range(n)]
    lookups = [channel.send(m.Lookup(reg, pack_hashes(h))) for h in chains]
    loads = [c.load(h, list(range(4 * (i % 8), 4 * (i % 8) + 4))) for i, h in enumerate(chains)]
    answered = sum(channel.poll_reply(rid, 120) is not None for rid in lookups)
    results = [h.wait() for h in loads]
    say(step="flooded", lookups=answered, loads=len(results), refused=sum(bool(r.error) for r in results))


def victim(c: Client, kv, first_token: int) -> None:
    hashes = block_hashes(list(range(first_token, first_token + 16 * 12)), 16)
    hits = c.lookup(hashes)
    ids = list(range(16, 16 + hits))
    res = c.load(hashes[:hits], ids).wait() if hits else None
    say(step="done", hits=hits, loaded=res.done if res else 0, digest=digest(kv, ids))


def main() -> None:
    role, socket, uid, arg = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    kv = make_kv(seed=99)
    drop_to(uid)
    with Client(socket, name=role, transfer_timeout=120.0) as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
        say(step="ready")
        sys.stdin.readline()
        if role == "flood":
            flood(c, arg)
        elif role == "victim":
            victim(c, kv, arg)
        else:  # "stats": what this tenant's stats show of the remote tier
            say(step="stats", remote=c.stats()["remote"])


if __name__ == "__main__":
    main()
