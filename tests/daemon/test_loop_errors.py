"""A bug outside request handling must not stop the daemon: an in-process
daemon whose config reloader fails in an unexpected way keeps serving."""

from __future__ import annotations

import threading

from kvtier.client import Client
from kvtier.daemon.config import DaemonConfig
from kvtier.daemon.server import Daemon
from tests.daemon.test_reaping import wait_for


def broken_reloader():
    raise RuntimeError("reloader bug")  # not the ValueError reload() expects


def test_housekeeping_error_is_logged_and_the_loop_goes_on(tmp_path, caplog):
    config = DaemonConfig(socket=str(tmp_path / "loop.sock"), pool_size=16 * 2**20, slab_size=2**20)
    daemon = Daemon(config, reloader=broken_reloader)
    loop = threading.Thread(target=daemon.serve_forever, daemon=True)
    loop.start()
    try:
        daemon.request_reload()  # what SIGHUP does; the loop runs the reload
        assert wait_for(lambda: daemon.errors["INTERNAL"] == 1, 10)
        assert loop.is_alive()
        with Client(config.socket, name="after", timeout=5.0, heartbeat=False) as c:
            assert c.stats()["errors"] == {"INTERNAL": 1}
        assert "reloader bug" in caplog.text
    finally:
        daemon.request_stop()
        loop.join(30)
    assert not loop.is_alive()
