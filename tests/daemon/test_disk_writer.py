"""The daemon's disk writes run in a writer process (kvtier/disk/writer.py): status names it,
a writer killed in the middle of a flood of stores loses no committed block (the daemon's own
threads write what it had not), and it never outlives its daemon, even a SIGKILLed one (a new
daemon empties tmp/ at start: an orphan still writing there would race it). Real daemons,
real files, real signals."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys

import pytest

from kvtier import cli

from tests.daemon.test_disk_lossless import drained, loads_back, store_chains
from tests.daemon.test_disk_tier import disk_env
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, make_kv

OTHER = 41055
PROLOGUE = f"import os\nos.setgroups([]); os.setresgid({OTHER}, {OTHER}, {OTHER}); os.setresuid({OTHER}, {OTHER}, {OTHER})\n"


def writer_pid(d) -> int:
    """The writer process's pid once it is ready (it starts beside the daemon's own start)."""
    assert wait_for(lambda: d.stats()["disk"]["writer"]["process"], 30)
    return d.stats()["disk"]["writer"]["process"]


def test_status_names_the_writer_process_and_threads_write_when_asked(daemon_factory, tmp_path):
    d = daemon_factory(process=True, env=disk_env(tmp_path / "disk"), pool_size="8MiB", slab_size="1MiB")
    w = {"process": writer_pid(d)}
    assert w["process"] and w["process"] != d.proc.pid
    with open(f"/proc/{w['process']}/status") as f:
        assert f"PPid:\t{d.proc.pid}\n" in f.read()
    t = daemon_factory(process=True, env=disk_env(tmp_path / "disk2", disk_writer="threads"), pool_size="8MiB",
                       slab_size="1MiB", socket=str(tmp_path / "t.sock"))
    assert t.stats()["disk"]["writer"] == {"process": None, "why": 'disk_writer = "threads"'}


def test_a_writer_killed_in_a_flood_of_stores_loses_no_committed_block(daemon_factory, tmp_path):
    """192 blocks stored back to back (more than the write-behind queue holds); the writer is
    SIGKILLed after the first chains: every block still reaches the disk and loads back exact."""
    d = daemon_factory(process=True, env=disk_env(tmp_path / "disk"), pool_size="8MiB", slab_size="1MiB")
    pid = writer_pid(d)
    kv = make_kv(seed=5)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        want = store_chains(c, kv, range(1, 3))
        os.kill(pid, signal.SIGKILL)
        want.update(store_chains(c, kv, range(3, 7)))
    s = drained(d)
    assert (s["written"], s["blocks"], s["not_written"]) == (192, 192, {})
    assert s["writer"]["process"] is None and "signal 9" in s["writer"]["why"]
    assert d.read_log().count("disk writer process") == 1  # the operator is told, once
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["status", "--socket", d.socket]) == 0
    line = next(x for x in out.getvalue().splitlines() if x.startswith("disk "))
    assert "writes on the daemon's threads: it was killed by signal 9" in line, line
    assert loads_back(d, kv, range(1, 7), want, exact=True) == 192


def test_the_writer_does_not_outlive_a_sigkilled_daemon(daemon_factory, tmp_path):
    d = daemon_factory(process=True, env=disk_env(tmp_path / "disk"), pool_size="8MiB", slab_size="1MiB")
    pid = writer_pid(d)
    d.proc.kill()
    d.proc.wait()

    def gone() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ")[1][0] == "Z"  # exited, not yet reaped by init
        except FileNotFoundError:
            return True
    assert wait_for(gone, 10)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: another uid")
def test_another_user_cannot_reach_the_writers_pool_socket_or_memory(daemon_factory, tmp_path):
    """The writer maps every tenant's blocks and holds the pool's descriptor: uid 41055 can open
    none of its descriptors, read none of its memory and signal it not at all."""
    d = daemon_factory(process=True, env=disk_env(tmp_path / "disk"), pool_size="8MiB", slab_size="1MiB")
    pid = writer_pid(d)
    fds = sorted(int(f) for f in os.listdir(f"/proc/{pid}/fd"))
    probe = ("import os, sys\nfor p in sys.argv[1:]:\n    try:\n        open(p, 'rb').read(1); print('read', p)\n"
             "    except OSError as e:\n        print('refused', e.errno)\n"
             f"try:\n    os.kill({pid}, 0); print('signalled')\nexcept PermissionError:\n    print('refused kill')\n")
    paths = [f"/proc/{pid}/fd/{fd}" for fd in fds] + [f"/proc/{pid}/mem", f"/proc/{pid}/environ"]
    out = subprocess.run([sys.executable, "-c", PROLOGUE + probe, *paths], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert not any(x.startswith(("read", "signalled")) for x in lines), out.stdout
    # EACCES, the kernel's ptrace check: not ENXIO (a socket cannot be opened, by root either)
    assert lines.count("refused 13") == len(paths) and "refused kill" in lines, out.stdout
