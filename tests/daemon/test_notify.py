"""The systemd notify protocol, with the test playing systemd.

The test binds the Unix datagram socket that systemd would, starts a real
kvtier-daemon subprocess with NOTIFY_SOCKET pointing at it, and reads what
the daemon announces: startup STATUS lines, READY=1 (only once the socket
accepts clients), WATCHDOG=1 pings, RELOADING=1 on SIGHUP, STOPPING=1 on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from kvtier.client import Client
from kvtier.daemon.notify import Notifier, sd_notify, watchdog_interval
from tests.conftest import REPO


class FakeSystemd:
    """The receiving end of NOTIFY_SOCKET: a path, or '@name' (abstract)."""

    def __init__(self, address: str):
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(b"\0" + address[1:].encode() if address.startswith("@") else address)
        self.seen: list[tuple[float, dict]] = []  # (arrival time, KEY -> value)

    def next(self, timeout: float) -> dict | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096)
        except socket.timeout:
            return None
        msg = dict(line.split("=", 1) for line in data.decode().splitlines())
        self.seen.append((time.monotonic(), msg))
        return msg

    def until(self, key: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self.next(left)
            if msg is not None and key in msg:
                return msg
        raise AssertionError(f"no {key} within {timeout}s; got {[m for _, m in self.seen]}")

    def collect(self, seconds: float) -> list[dict]:
        out, deadline = [], time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            msg = self.next(left)
            if msg is not None:
                out.append(msg)
        return out

    def close(self):
        self.sock.close()


def start_daemon(tmp_path, notify: str, args=(), env=None):
    sock = str(tmp_path / "kvt.sock")
    log = open(tmp_path / "daemon.log", "w")
    full_env = {**os.environ, "PYTHONPATH": REPO, "NOTIFY_SOCKET": notify, **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.daemon", "--socket", sock, *args],
                            stdout=log, stderr=subprocess.STDOUT, env=full_env)
    return proc, sock


def stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_ready_means_serving_then_watchdog_then_stopping(tmp_path):
    systemd = FakeSystemd(f"@kvtier-test-{uuid.uuid4().hex}")  # abstract namespace, like '@' in systemd
    proc, sock = start_daemon(tmp_path, systemd.address,
                              ["--pool-size", "64MiB", "--slab-size", "4MiB"],
                              env={"WATCHDOG_USEC": "400000"})
    try:
        ready = systemd.until("READY")
        # READY carries the main pid; the startup steps were announced before it.
        assert ready["READY"] == "1" and int(ready["MAINPID"]) == proc.pid
        steps = [m["STATUS"] for _, m in systemd.seen[:-1] if "STATUS" in m]
        assert any(s.startswith("mapping pool") for s in steps), steps
        assert any(s.startswith("binding") for s in steps), steps
        assert "serving" in ready["STATUS"]

        # At READY the socket already listens (a plain connect succeeds at once,
        # no ZeroMQ reconnect behind it) and serves a real client.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(sock)
        with Client(sock, name="first", timeout=2.0, heartbeat=False) as c:
            assert [x["name"] for x in c.stats()["clients"]] == ["first"]

        # WATCHDOG_USEC=0.4 s: pings come about every 0.2 s, from the loop.
        first = len(systemd.seen)
        systemd.collect(1.2)
        stamps = [t for t, m in systemd.seen[first:] if m.get("WATCHDOG") == "1"]
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        assert 4 <= len(stamps) <= 8, systemd.seen[first:]
        assert all(0.1 < g < 0.4 for g in gaps), gaps  # about half of 0.4 s, never the full period

        # SIGTERM: STOPPING=1 while draining, then a clean exit.
        proc.send_signal(signal.SIGTERM)
        assert systemd.until("STOPPING", timeout=30)["STOPPING"] == "1"
        assert proc.wait(30) == 0
    finally:
        stop(proc)
        systemd.close()


def write_config(path, **values):
    lines = [f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in values.items()]
    path.write_text("\n".join(lines).replace("'", '"') + "\n")


def test_sighup_applies_safe_keys_and_names_the_rest(tmp_path):
    systemd = FakeSystemd(str(tmp_path / "notify"))  # a path socket, like /run/systemd/notify
    conf = tmp_path / "kvtier.toml"
    base = dict(pool_size="64MiB", slab_size="4MiB", swap_quota=0, reap_after_s=10.0)
    write_config(conf, **base)
    proc, sock = start_daemon(tmp_path, systemd.address, ["--config", str(conf)])
    log = tmp_path / "daemon.log"
    try:
        systemd.until("READY")

        # An operator edits a reloadable key, another reloadable key and a
        # pool key, then runs `systemctl reload` (SIGHUP).
        write_config(conf, **{**base, "swap_quota": "1MiB", "reap_after_s": 30.0, "pool_size": "128MiB"})
        proc.send_signal(signal.SIGHUP)
        reloading = systemd.until("RELOADING")
        assert int(reloading["MONOTONIC_USEC"]) > 0
        assert systemd.until("READY", timeout=10)["READY"] == "1"

        # New clients get the new swap quota; the pool keeps its size.
        with Client(sock, name="after-reload", timeout=5.0, heartbeat=False) as c:
            s = c.stats()
        assert s["clients"][0]["swap_quota"] == 2**20
        assert s["pool"]["capacity_bytes"] == 64 * 2**20
        [line] = [x for x in log.read_text().splitlines() if "reload: changed" in x]
        changed, ignored = line.split("reload: changed ")[1].split("; ignored until restart ")
        assert sorted(changed.split(", ")) == ["reap_after_s=30.0", "swap_quota=1048576"]
        assert ignored == "pool_size"

        # A broken edit is refused as a whole; the daemon keeps serving.
        write_config(conf, **{**base, "swap_quota": "lots"})
        proc.send_signal(signal.SIGHUP)
        ready = systemd.until("READY", timeout=10)
        assert "last reload failed" in ready["STATUS"]
        with Client(sock, name="after-bad-reload", timeout=5.0, heartbeat=False) as c:
            assert c.stats()["clients"][0]["swap_quota"] == 2**20
        assert "reload failed" in log.read_text() and "swap_quota" in log.read_text()

        # Without WATCHDOG_USEC there are no watchdog pings.
        assert not [m for _, m in systemd.seen if "WATCHDOG" in m]
    finally:
        stop(proc)
        systemd.close()


def test_sd_notify_path_and_abstract_addresses(tmp_path):
    for address in (str(tmp_path / "n.sock"), f"@kvtier-{uuid.uuid4().hex}"):
        systemd = FakeSystemd(address)
        try:
            assert sd_notify("STATUS=hello\nREADY=1", address)
            assert systemd.next(2.0) == {"STATUS": "hello", "READY": "1"}
        finally:
            systemd.close()
    assert sd_notify("READY=1", "") is False                          # unsupervised: no-op
    assert sd_notify("READY=1", str(tmp_path / "absent")) is False    # systemd gone: not fatal


def test_watchdog_interval_rules():
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) == 0.0  # not ours
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "junk"}) == 0.0
    assert watchdog_interval({}) == 0.0
    # Unsupervised, the tick never asks the loop to wake up early.
    assert Notifier({}).watchdog_tick() == float("inf")


def test_watchdog_tick_paces_at_half_period(tmp_path):
    systemd = FakeSystemd(str(tmp_path / "wd.sock"))
    try:
        n = Notifier({"NOTIFY_SOCKET": systemd.address, "WATCHDOG_USEC": "1000000"})
        assert n.watchdog_tick(now=100.0) == pytest.approx(0.5)   # first tick pings at once
        assert n.watchdog_tick(now=100.3) == pytest.approx(0.2)   # too early: silent
        assert n.watchdog_tick(now=100.5) == pytest.approx(0.5)   # due: pings again
        assert systemd.collect(0.2) == [{"WATCHDOG": "1"}, {"WATCHDOG": "1"}]
    finally:
        systemd.close()
