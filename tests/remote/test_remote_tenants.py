"""Tenants sharing a node's remote tier cannot crowd each other out (issue 30), against
real daemons, real other Unix users and a real three-master Redis Cluster stalled
with SIGSTOP (alive, silent) while the flood is queued:

- loads waiting for a fetch count toward their user's ``max_transfers_per_user``;
- one tenant holds at most ``max_probes_per_tenant`` of the probe slots, and the
  probe and fetch threads serve tenants in turn, so another tenant's lookup still
  asks the store and its fetch runs next, not behind the flood;
- the store's last error, which every client's stats show, names no key.

No timing assertions: the figures in RELIABILITY.md are what these tests print with ``-s``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from kvtier.client import block_hashes
from kvtier.pool.keys import ns_key
from kvtier.remote.settings import RemoteSettings
from kvtier.remote.store import describe
from kvtier.remote.tier import RemoteTier
from tests.conftest import REPO
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, make_kv
from tests.remote.cluster import LocalCluster
from tests.remote.conftest import SECRET, running_cluster
from tests.remote.test_tier import SIZE, chain, filled_pool, wait_jobs
from tests.remote.test_two_nodes import (CODEC, TOKENS, engine_blocks, node, remote_stats, store_prefix,  # noqa: F401
                                         wait_remote, _secret_file)

UID = os.geteuid()
VICTIM, FLOODER = 41031, 41032
FLOOD = 100  # lookups, and as many loads, from the flooding tenant
WORKER = os.path.join(REPO, "tests", "remote", "tenant_worker.py")
needs_root = pytest.mark.skipif(UID != 0, reason="tenants are other Unix users: needs root")


@pytest.fixture
def own_cluster():
    """A cluster this test stops and resumes."""
    yield from running_cluster()


def stalled(cl):
    """SIGSTOP every master; the caller SIGCONTs them (``resumed``) in a finally."""
    for p in cl.procs:
        p.send_signal(signal.SIGSTOP)


def resumed(cl):
    for p in cl.procs:
        p.send_signal(signal.SIGCONT)


def test_loads_waiting_on_a_stalled_fetch_count_toward_the_users_transfer_cap(daemon_factory, own_cluster):
    """``max_transfers_per_user`` 4 and the store stalled: 48 loads of blocks only the store
    holds, one block each. 4 wait for their fetch, the other 44 are refused OVER_LIMIT at once
    (before: all 48 sat in the daemon uncounted; the disk tier's twin is in
    tests/daemon/test_disk_trust.py). Meanwhile the daemon answers a lookup of a chain in
    its RAM; once the store answers, the 4 load byte for byte and the cap is free again."""
    cl = own_cluster
    a = node(daemon_factory, cl.url)
    prompts = [[t + 1_800_000 + 10_000 * k for t in TOKENS] for k in range(4)]
    expected = [b for k, p in enumerate(prompts) for b in store_prefix(a, p, seed=40 + k)]
    wait_remote(a, "written", 48)
    hashes = [h for p in prompts for h in block_hashes(p, 16)]
    b = node(daemon_factory, cl.url, env={"KVTIER_REMOTE_TIMEOUT_S": "30", "KVTIER_MAX_TRANSFERS_PER_USER": "4"})
    local = [t + 1_900_000 for t in TOKENS]
    store_prefix(b, local, seed=45)
    wait_remote(b, "written", 12)  # nothing of B's own in flight to the store when it stalls
    kv, kv2 = make_kv(seed=98), make_kv(seed=97)
    layers = len(kv.tensors)
    with b.client(name="engine", transfer_timeout=120.0) as c, b.client(name="other") as other:
        c.register_kv_cache(kv, [0] * layers, NS)
        other.register_kv_cache(kv2, [0] * layers, NS)
        stalled(cl)
        try:
            handles = [c.load([h], [i % 32]) for i, h in enumerate(hashes)]
            wait_for(lambda: sum(h.done() for h in handles) >= 44, 10)
            refused = [h for h in handles if h.done()]
            waiting, counted = len(b.daemon.remote.fetching), remote_stats(b).get("loads_waiting")
            served = other.lookup(block_hashes(local, 16))  # from RAM: no probe, no wait
        finally:
            resumed(cl)
        print(f"\nstalled fetches, cap 4: {waiting} loads waiting, {len(refused)} of 48 refused at once; "
              f"a RAM lookup meanwhile: {served} of 12 hits")
        assert waiting == counted == 4 and len(refused) == 44 and served == 12
        assert all("max_transfers_per_user" in h.wait().error for h in refused)  # OVER_LIMIT
        rest = [h.wait() for h in handles if h not in refused]
        assert len(rest) == 4 and all(r.ok for r in rest)
        assert engine_blocks(kv, range(4)) == expected[:4 * layers]
        assert c.load(hashes[4:8], [4, 5, 6, 7]).wait().ok  # the cap is free again
        assert remote_stats(b)["loads_waiting"] == 0
    kv.close()
    kv2.close()


def test_fetches_and_probes_take_turns_by_tenant_and_one_holds_a_bounded_share_of_probes(own_cluster):
    """The tier alone, the store stalled with one job of each kind hung on it: tenant beta
    asks 40 probes and queues 20 fetches, then alpha asks one of each. Beta gets 16 probe
    slots (``max_probes_per_tenant``), the other 24 answer locally; alpha's probe is
    admitted, and once the store answers, alpha's probe and fetch each run right after the
    job that was hung (before: alpha's probe was refused with 64 slots free to beta, and
    its fetch ran 21st, after all of beta's). Alpha's bytes arrive exactly."""
    cl = own_cluster
    alpha, beta = ns_key("alpha", NS.fingerprint()), ns_key("beta", NS.fingerprint())
    pool = filled_pool(12)
    t = RemoteTier(RemoteSettings(cl.url, secret=SECRET, timeout_s=30.0), pool)
    try:
        keys = chain(1, 4)
        assert t.write(alpha, keys, [i * SIZE for i in range(4)], SIZE, "w") == 4
        assert not wait_jobs(t, 1, 60)[0].failed
        assert t.probe(beta, chain(2, 1), "warm", tenant="beta")  # the probe and fetch threads are connected
        assert t.fetch(alpha, keys[:1], [8 * SIZE], SIZE, "warm", tenant="alpha")
        assert not any(j.error for j in wait_jobs(t, 2, 60))
        stalled(cl)
        try:
            took = [t.probe(beta, chain(3 + i, 4), ("beta", i), tenant="beta") for i in range(40)]
            alpha_probed = t.probe(alpha, keys, "alpha", tenant="alpha")
            for i in range(20):
                assert t.fetch(beta, chain(60 + i, 1), [11 * SIZE], SIZE, ("beta", i), tenant="beta")
            assert t.fetch(alpha, keys, [(4 + i) * SIZE for i in range(4)], SIZE, "alpha", tenant="alpha")
            held = t.stats()["probes_waiting"]
        finally:
            resumed(cl)
        jobs = wait_jobs(t, took.count(True) + alpha_probed + 21, 60)
        probes = [j.token for j in jobs if j.kind == "probe"]
        fetches = [j.token for j in jobs if j.kind == "fetch"]
        print(f"\nbeta flooding: {took.count(True)} of 40 probes admitted, {held} slots held, alpha's probe "
              f"admitted: {alpha_probed}, answered {probes.index('alpha') + 1}th; alpha's fetch ran "
              f"{fetches.index('alpha') + 1}th of 21")
        assert took.count(True) == 16 and alpha_probed and held == 17
        assert t.stats()["probe_over_share"] == 24
        assert probes.index("alpha") <= 1 and fetches.index("alpha") <= 1
        [probe] = [j for j in jobs if j.token == "alpha" and j.kind == "probe"]
        [fetch] = [j for j in jobs if j.token == "alpha" and j.kind == "fetch"]
        assert probe.hits == 4 and fetch.failed == []
        assert pool[4 * SIZE:8 * SIZE] == pool[:4 * SIZE]  # fetched back byte for byte
    finally:
        t.close()


def start_worker(role: str, socket: str, uid: int, arg: int) -> subprocess.Popen:
    env = {"PYTHONPATH": REPO, "HOME": "/tmp", "PATH": os.environ.get("PATH", "")}
    p = subprocess.Popen([sys.executable, WORKER, role, socket, str(uid), str(arg)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline()
    assert line and json.loads(line)["step"] == "ready", p.stderr.read()[-3000:] if p.poll() is not None else line
    return p


def answer(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.splitlines()[-1])


def go(p: subprocess.Popen) -> None:
    p.stdin.write("go\n")
    p.stdin.flush()


@needs_root
def test_a_tenant_flooding_lookups_and_loads_leaves_another_tenants_remote_hits_intact(daemon_factory,
                                                                                      own_cluster):
    """Node B serves two other Unix users, tenants alpha and beta (the operator named them:
    their blocks cross nodes). Node A stored alpha's 12-block prompt in the store. With the
    store stalled, beta sends 100 lookups and 100 loads of blocks B lacks, then alpha looks up
    its prompt and loads it. Beta holds 16 probe slots; alpha's lookup asks the store and
    finds all 12 blocks, and its load brings them byte for byte (before: beta held all 64
    slots and alpha's lookup was answered from RAM alone: 0 hits, nothing loaded)."""
    cl = own_cluster
    prompt = [t + 2_500_000 for t in TOKENS]
    a = node(daemon_factory, cl.url, tenants=f"alpha:{UID}")
    expected = hashlib.sha256(b"".join(store_prefix(a, prompt, seed=51))).hexdigest()
    wait_remote(a, "written", 12)
    run = tempfile.mkdtemp(prefix="kvt-remote-tenants-")
    os.chmod(run, 0o755)
    try:
        b = node(daemon_factory, cl.url, tenants=f"alpha:{VICTIM}; beta:{FLOODER}",
                 socket=os.path.join(run, "kvtier.sock"),
                 env={"KVTIER_SOCKET_MODE": "666", "KVTIER_REMOTE_TIMEOUT_S": "30"})
        flooder = start_worker("flood", b.socket, FLOODER, FLOOD)
        victim = start_worker("victim", b.socket, VICTIM, prompt[0])
        remote = b.daemon.remote
        queued = lambda: remote.tier.probe_slots.held + remote_stats(b)["probe_skipped"]  # noqa: E731
        stalled(cl)
        try:
            go(flooder)
            assert wait_for(lambda: queued() == FLOOD and len(remote.fetching) == FLOOD, 30)
            go(victim)
            assert wait_for(lambda: queued() == FLOOD + 1, 30)  # alpha's lookup: asked, or answered locally
            held = remote.tier.probe_slots.held
        finally:
            resumed(cl)
        done, flooded = answer(victim), answer(flooder)
        s = remote_stats(b)
        print(f"\nbeta flooding {FLOOD} lookups + {FLOOD} loads: {held} probe slots held at alpha's lookup, "
              f"{s['probe_skipped']} lookups answered locally; alpha: {done['hits']} of 12 hits, "
              f"{done['loaded']} loaded; beta's answers: {flooded}")
        assert done["hits"] == 12 and done["loaded"] == 12 and done["digest"] == expected
        assert held == 17 and s["probe_over_share"] == FLOOD - 16
        from kvtier.daemon.metrics import SnapshotCollector
        over = {f.name: f.samples[0].value for f in SnapshotCollector(lambda: b.stats()).collect() if f.samples}
        assert over["kvtier_remote_probes_over_share"] == FLOOD - 16  # for the operator's scraper too
        assert flooded["lookups"] == FLOOD and flooded["loads"] == FLOOD
    finally:
        shutil.rmtree(run, ignore_errors=True)


@needs_root
def test_the_store_error_every_client_sees_names_no_tenants_keys(daemon_factory):
    """Masters of 1 MiB that refuse writes (``noeviction``): tenant alpha's blocks are
    refused (``rejected``), so the tier's ``last_error``, shown in every client's stats, is
    about alpha's writes. Tenant beta (another uid) reads it: the reason (OOM), never a key,
    alpha's namespace digest or a block hash (checked before and after: redis-py does not
    quote the command for these; ``store.describe`` cuts it where it would)."""
    cl = LocalCluster(maxmemory="1mb")
    run = tempfile.mkdtemp(prefix="kvt-remote-errors-")
    os.chmod(run, 0o755)
    try:
        b = node(daemon_factory, cl.url, tenants=f"alpha:{UID}; beta:{FLOODER}",
                 socket=os.path.join(run, "kvtier.sock"), env={"KVTIER_SOCKET_MODE": "666"})
        hashes = []
        for k in range(10):  # 1.9 MiB of values for 3 MiB of masters that hold ~1 MiB of their own
            prompt = [t + 2_600_000 + 10_000 * k for t in TOKENS]
            store_prefix(b, prompt, seed=60 + k)
            hashes += block_hashes(prompt, 16)
        assert wait_for(lambda: remote_stats(b)["rejected"] > 0, 30)
        seen = json.loads(json.dumps(remote_stats(b)))
        beta = start_worker("stats", b.socket, FLOODER, 0)
        go(beta)
        shown = answer(beta)["remote"]
    finally:
        cl.close()
        shutil.rmtree(run, ignore_errors=True)
    digest = CODEC.namespace(ns_key("alpha", NS.fingerprint())).short.decode()
    print(f"\nlast_error shown to another tenant: {shown['last_error']!r} ({seen['rejected']} writes refused)")
    assert "OutOfMemoryError" in shown["last_error"] and shown["last_error"] == seen["last_error"]
    text = json.dumps(shown)
    assert "kvt" not in text and digest not in text and not any(h.hex()[:16] in text for h in hashes)


def test_a_store_error_quoting_its_command_loses_the_key_and_the_value():
    """redis-py annotates a raised pipeline error with the command (key and value bytes):
    what reaches ``last_error`` keeps the reason only."""
    import redis
    key = CODEC.key(CODEC.namespace(ns_key("alpha", NS.fingerprint())), bytes(range(16))).decode()
    exc = redis.exceptions.ResponseError(f"Command # 3 (SET {key} b'\\x07secret) bytes' PX 1000) of pipeline "
                                         "caused error: OOM command not allowed when used memory > 'maxmemory'.")
    said = describe(exc)
    assert said == ("ResponseError: Command # 3 (<command>) of pipeline caused error: OOM command not allowed "
                    "when used memory > 'maxmemory'.")
    assert describe(redis.exceptions.ResponseError(f"WRONGTYPE {key}")) == "ResponseError: WRONGTYPE <key>"
