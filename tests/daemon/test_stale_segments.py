"""KV segments of workers the daemon cannot reap are swept once their creator is dead.

A worker killed between creating its KV segment and HELLO, or one that said
BYE and exited without closing its cache, is no client of the daemon, so no
reap unlinks its segment; the periodic sweep does.
"""

from __future__ import annotations

import os

from kvtier.client import Client
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, make_kv, spawn


def create_and_vanish(name_file: str) -> None:
    kv = make_kv()
    with open(name_file, "w") as f:
        f.write(kv.name)
    os._exit(0)  # dies before HELLO, no cleanup


def bye_and_vanish(socket: str, name_file: str) -> None:
    kv = make_kv()
    c = Client(socket, name="leaves")
    c.register_kv_cache(kv, [0] * 4, NS)
    c.close()  # BYE: the daemon forgets this client
    with open(name_file, "w") as f:
        f.write(kv.name)
    os._exit(0)  # never closes its cache


def test_segments_of_dead_non_clients_are_swept(process_daemon, tmp_path):
    daemon = process_daemon
    names = []
    for i, (target, args) in enumerate([(create_and_vanish, ()), (bye_and_vanish, (daemon.socket,))]):
        path = str(tmp_path / f"name-{i}")
        p, _ = spawn(target, *args, path)
        p.join(60)
        assert p.exitcode == 0
        names.append(open(path).read().lstrip("/"))
    # The daemon's periodic sweep removes them (any engine of this user starting a
    # cache sweeps too, so with tests running in parallel it may be another one).
    assert wait_for(lambda: not any(os.path.exists(f"/dev/shm/{n}") for n in names), 10), names
    daemon.stats()  # and the daemon is fine
