"""Structured logs: one JSON object per line; one line per client event and per
error; nothing per block."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from kvtier.client import block_hashes
from tests.conftest import REPO
from tests.helpers import NS, make_kv

# A client process that says HELLO and dies without BYE: the daemon must reap it.
DIES = ("from kvtier.client import Client; import os; "
        "Client({!r}, name='doomed', heartbeat=False); os._exit(0)")


def records(d) -> list[dict]:
    return [json.loads(line) for line in d.read_log().splitlines() if line.strip()]


def wait_for(d, text, timeout=10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = records(d)
        if any(text in r["msg"] for r in recs):
            return recs
        time.sleep(0.05)
    raise AssertionError(f"no log line with {text!r}: {d.read_log()}")


def test_json_lines_per_event_not_per_block(daemon_factory):
    d = daemon_factory(process=True, extra=["--log-format", "json"])
    kv = make_kv(seed=5)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
        lines_before = len(records(d))
        # 24 blocks in 3 stores and a 24-block load: no log line at all.
        hashes = block_hashes(list(range(16 * 24)), 16)
        for i in range(0, 24, 8):
            assert c.store(hashes[i:i + 8], list(range(i, i + 8))).wait().done == 8
        c.load(hashes[:24], list(range(24))).wait()
        assert len(records(d)) == lines_before
        # One bad request: exactly one WARNING line naming the error code.
        assert not c.load(hashes[:1], [999]).wait().ok
        recs = wait_for(d, "BAD_ARGUMENT")
    kv.close()

    subprocess.run([sys.executable, "-c", DIES.format(d.socket)], env={**os.environ, "PYTHONPATH": REPO},
                   check=True, timeout=60)
    recs = wait_for(d, "reaped (process exited)")

    for r in recs:  # every line is a full record
        assert set(r) >= {"ts", "level", "logger", "msg", "pid"} and r["pid"] == d.proc.pid
    errors = [r for r in recs if "BAD_ARGUMENT" in r["msg"]]
    assert len(errors) == 1 and errors[0]["level"] == "WARNING"
    connects = [r["msg"] for r in recs if " connected: " in r["msg"]]
    assert [m.split("name=")[1] for m in connects] == ["'engine'", "'doomed'"]
    assert len([r for r in recs if "disconnected" in r["msg"]]) == 1  # the engine's BYE
    reaped = [r for r in recs if "reaped" in r["msg"]]
    assert len(reaped) == 1 and reaped[0]["level"] == "INFO"
