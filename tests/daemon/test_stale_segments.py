"""Engine KV memory leaves nothing behind, however its worker ends.

KV caches used to be named segments in /dev/shm that a sweep had to unlink
after workers that died before HELLO or after BYE. They are now sealed
memfds handed over as descriptors: nameless, freed by the kernel when the
worker and the daemon's mapping are gone, so there is nothing to sweep.
"""

from __future__ import annotations

import os

from kvtier.client import Client
from tests.helpers import NS, make_kv, spawn


def create_and_vanish() -> None:
    make_kv()
    os._exit(0)  # dies before HELLO, no cleanup


def bye_and_vanish(socket: str) -> None:
    kv = make_kv()
    c = Client(socket, name="leaves")
    c.register_kv_cache(kv, [0] * 4, NS)
    c.close()  # BYE: the daemon forgets this client
    os._exit(0)  # never closes its cache


def test_workers_that_vanish_leave_nothing_in_dev_shm(daemon):
    before = set(os.listdir("/dev/shm"))
    for target, args in [(create_and_vanish, ()), (bye_and_vanish, (daemon.socket,))]:
        p, _ = spawn(target, *args)
        p.join(60)
        assert p.exitcode == 0
    assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("kvtier-kv.")}
    assert daemon.stats()["clients"] == []
