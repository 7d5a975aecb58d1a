"""A short run of scripts/soak.py: workers SIGKILLed at random, every byte verified."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO


def test_soak_smoke():
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "soak.py"), "--seconds", "8",
                          "--clients", "3", "--kill-every", "0.4", "--seed", "7", "--json"],
                         env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=180)
    assert out.stdout.strip(), out.stderr[-3000:]
    s = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nsoak smoke: {s['kills']} kills, {s['operations']} operations, "
          f"{s['bytes_verified']} bytes verified, {s['mismatches']} mismatches, {s['leaks']} leaks")
    assert out.returncode == 0 and s["ok"], (s["problems"], out.stderr[-3000:])
    assert s["kills"] >= 3 and s["workers_started"] > 3
    assert s["mismatches"] == 0 and s["leaks"] == 0 and s["restore_failed"] == 0
    # Every kind of operation ran and was checked.
    assert s["loads"] > 0 and s["stores"] > 0 and s["restores"] > 0 and s["bytes_verified"] > 0
    assert s["integrity"] == "ok" and s["clients_left"] == 0 and s["swap_bytes"] == 0
