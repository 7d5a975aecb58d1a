"""``kvtier top|clients|namespaces`` against a real daemon, through main(argv)."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import termios
import threading
import time

import pytest

from kvtier.cli import main
from kvtier.client import block_hashes
from kvtier.top import rates
from tests.conftest import REPO
from tests.helpers import NS, make_kv

HASHES = block_hashes(list(range(16 * 24)), 16)


@pytest.fixture
def engine(daemon):
    """A connected engine with 8 blocks stored."""
    kv = make_kv(seed=7)
    c = daemon.client(name="engine-x")
    c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
    assert c.store(HASHES[:8], list(range(8))).wait().done == 8
    yield c
    c.close()
    kv.close()


def run(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_namespaces_json_and_table(daemon, engine, capsys):
    code, out = run(capsys, "namespaces", "--socket", daemon.socket, "--json")
    assert code == 0
    [ns] = json.loads(out)
    assert (ns["fingerprint"], ns["blocks"], ns["bytes"], ns["stored"]) == (NS.fingerprint(), 8, 8 * 16384, 8)

    code, out = run(capsys, "namespaces", "--socket", daemon.socket)
    header, row = out.strip().splitlines()
    assert header.split()[:4] == ["ID", "NAMESPACE", "BLOCK", "BLOCKS"]
    assert row.split()[1:6] == [NS.fingerprint(), "16.00", "KiB", "8", "128.00"]


def test_clients_json_and_table(daemon, engine, capsys):
    code, out = run(capsys, "clients", "--socket", daemon.socket, "--json")
    rows = {c["name"]: c for c in json.loads(out)}
    assert set(rows) == {"engine-x"}  # the CLI asking is not listed
    assert rows["engine-x"]["namespaces"] == [NS.fingerprint()]
    assert rows["engine-x"]["inflight"] == 0

    code, out = run(capsys, "clients", "--socket", daemon.socket)
    assert code == 0
    engine_row = [line for line in out.splitlines() if "engine-x" in line]
    assert len(engine_row) == 1 and NS.fingerprint() in engine_row[0]
    assert str(rows["engine-x"]["pid"]) in engine_row[0]


def test_top_json_rates_follow_traffic(daemon, engine, capsys):
    """top samples every 0.3 s while the engine stores 16 more blocks: the
    per-interval rates must add up to exactly what was stored."""
    result = {}
    top = threading.Thread(target=lambda: result.update(code=main(
        ["top", "--socket", daemon.socket, "--json", "--iterations", "6", "--interval", "0.3"])))
    top.start()
    seen = ""  # what top printed so far (read while it runs)
    while "{" not in seen and top.is_alive():  # the first frame is out: traffic starts after it
        seen += capsys.readouterr().out
        time.sleep(0.01)
    for i in range(8, 24, 4):
        assert engine.store(HASHES[i:i + 4], list(range(i, i + 4))).wait().done == 4
    top.join(30)
    assert result["code"] == 0
    frames = [json.loads(line) for line in (seen + capsys.readouterr().out).splitlines()]
    assert len(frames) == 6
    assert frames[0]["rates"] == {} and all(f["rates"] for f in frames[1:])
    assert frames[0]["totals"]["stored"] == 8 and frames[-1]["totals"]["stored"] == 24
    added = sum(f["rates"]["stored"] * f["rates"]["interval_s"] for f in frames[1:])
    assert added == pytest.approx(16)
    assert max(f["rates"]["store_bytes"] for f in frames[1:]) > 0
    assert any("store" in f["latency_avg_s"] for f in frames[1:])


def test_top_text_without_tty_has_no_escape_codes(daemon, engine, capsys):
    code, out = run(capsys, "top", "--socket", daemon.socket, "--iterations", "2", "--interval", "0.1")
    assert code == 0
    assert out.count("kvtier top  pid") == 2 and "\x1b[" not in out
    assert NS.fingerprint()[:40] in out
    first, second = out.split("kvtier top  pid")[1:]
    assert "requests -" in first and "requests -" not in second  # rates need two snapshots


def test_no_daemon_exits_3(tmp_path, capsys):
    for cmd in ("top", "clients", "namespaces"):
        assert main([cmd, "--socket", str(tmp_path / "none.sock"), "--timeout", "0.2", "--json"]) == 3
        assert "no kvtier daemon" in capsys.readouterr().err


def test_rates_are_per_second_and_reset_on_restart():
    def snap(pid, uptime, stored, hits, misses, errors):
        totals = {"stored": stored, "hits": hits, "misses": misses}
        return {"pid": pid, "uptime_s": uptime, "totals": totals, "errors": {"BAD_ARGUMENT": errors}}

    r = rates(snap(1, 10.0, 100, 30, 10, 1), snap(1, 12.0, 140, 36, 12, 3))
    assert (r["stored"], r["hits"], r["errors"], r["interval_s"]) == (20.0, 3.0, 1.0, 2.0)
    assert r["hit_rate"] == pytest.approx(0.75)
    assert rates(None, snap(1, 1.0, 0, 0, 0, 0)) == {}
    assert rates(snap(1, 50.0, 9, 0, 0, 0), snap(2, 1.0, 0, 0, 0, 0)) == {}  # daemon restarted


@pytest.mark.parametrize("key", [b"q", b"\x03"], ids=["q", "ctrl-c"])
def test_top_on_a_terminal_quits_on_key_and_restores_it(daemon, key):
    """Run top on a pseudo-terminal like a person would: it redraws with ANSI
    codes, quits on q or Ctrl-C, and leaves the terminal as it found it."""
    master, slave = pty.openpty()
    before = termios.tcgetattr(slave)
    # The child takes the pty as its controlling terminal, so ^C becomes SIGINT.
    code = ("import fcntl, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
            f"from kvtier.cli import main; sys.exit(main(['top', '--socket', {daemon.socket!r}]))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=slave, stdout=slave, stderr=slave,
                            env={**os.environ, "PYTHONPATH": REPO}, start_new_session=True)
    try:
        screen = read_until(master, b"kvtier top  pid", timeout=30)
        assert b"\x1b[H\x1b[J" in screen  # a full redraw, not scrolling output
        os.write(master, key)
        # A bound, not a timing claim: at load 7-8 on 2 cores the Ctrl-C case twice took
        # over 10 s to exit (its client's threads wind down); it passes alone in seconds.
        assert proc.wait(60) == 0
        assert termios.tcgetattr(slave) == before
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
        os.close(slave)


def read_until(fd, marker: bytes, timeout: float) -> bytes:
    out, deadline = b"", time.monotonic() + timeout
    while marker not in out and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            out += os.read(fd, 65536)
    assert marker in out, out
    return out

