"""Real vLLM engines (CPU build) share a prompt prefix through a real kvtier daemon.

One module-scoped run. In one process, one engine after another: a
reference engine without kvtier; engine A with kvtier (stores the prefixes);
an engine whose namespace differs (float32 instead of bfloat16); an engine
with kvtier configured and no daemon at its socket. Then, in a new process
deployed as vLLM deploys (engine core and worker processes), engine B
with kvtier, which pauses halfway so the test can read ``kvtier status`` and
then SIGKILL the daemon before B answers the rest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import REPO, DaemonProc
from tests.integrations.test_vllm_hybrid import run_engines
from tests.integrations.vllm_example import example, require_vllm

PREFIX_TOKENS = 320          # 10 chunks of 32 tokens per shared prefix
PROMPTS_PER_PREFIX = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_vllm()
    ex = example()
    tmp = tmp_path_factory.mktemp("vllm")
    model = ex.make_tiny_llama(str(tmp / "tiny-llama"))
    # Two prefixes: B loads the first from kvtier, then the daemon dies and B
    # must compute the second itself.
    first = ex.shared_prefix_prompts(PREFIX_TOKENS, PROMPTS_PER_PREFIX)
    second = [[(t * 7) % 500 + 1 for t in p] for p in ex.shared_prefix_prompts(PREFIX_TOKENS, PROMPTS_PER_PREFIX)]
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(first + second))
    daemon = DaemonProc(tmp, pool_size="256MiB", slab_size="4MiB")
    out: dict = {}
    try:
        args = lambda **kw: ex.engine_command(model, str(prompts), **kw)[3:]  # noqa: E731
        # The reference, A, the other namespace and the engine with no daemon run one after
        # another in one process (vLLM imported once, no engine-core process: ~3 s an engine
        # where a process of its own costs ~70 s of CPU here); B, which must be a new
        # process to load A's prefix, runs as engines are deployed (engine core and worker
        # in processes of their own).
        (out["ref"], out["a"], out["other"], out["no_daemon"]), _ = run_engines(ex, [
            args(socket=None, kvtier=False),
            args(socket=daemon.socket),
            args(socket=daemon.socket, dtype="float32"),
            args(socket=str(tmp / "absent.sock")),  # kvtier configured, nobody at the socket
        ], tmp, "first")
        out["status_after_other"] = daemon.stats()
        out["b"], out["status_mid_b"] = _engine_b_with_daemon_killed(ex, model, str(prompts), daemon, tmp)
        yield out
    finally:
        daemon.stop()


def _engine_b_with_daemon_killed(ex, model, prompts, daemon, tmp):
    """Engine B answers the first prefix's prompts, pauses; we read ``kvtier
    status --json`` and SIGKILL the daemon; B answers the rest without it."""
    sync = tmp / "sync-b"
    sync.mkdir()
    cmd = ex.engine_command(model, prompts, socket=daemon.socket, pause_after=PROMPTS_PER_PREFIX, sync_dir=str(sync))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ex.engine_env())
    err: list[str] = []
    drain = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    drain.start()
    try:
        while not (sync / "paused").exists():  # readiness handshake, not a sleep
            if proc.poll() is not None:
                raise AssertionError(f"engine B exited early: {proc.stdout.read()[-3000:]}")
            threading.Event().wait(0.1)
        # B's lookups were answered by its lookup mirror: the daemon counts them once B's client
        # reports them, ahead of its next request or on its heartbeat (1 s; README). B is idle
        # now, so status is read again until they are in (a CI run read it first).
        deadline = time.monotonic() + 15
        while True:
            status = json.loads(subprocess.run(
                [sys.executable, "-c", "from kvtier.cli import main; raise SystemExit(main())",
                 "status", "--json", "--socket", daemon.socket],
                capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": REPO}).stdout)
            if _ns(status, "bfloat16")["hits"] or time.monotonic() > deadline:
                break
        daemon.stop(sig=signal.SIGKILL)
        (sync / "resume").touch()
        stdout, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    drain.join(5)
    assert proc.returncode == 0, "".join(err)[-4000:]
    return ex.parse_result(stdout), status


def _ns(status, dtype):
    found = [n for n in status["namespaces"] if f"|{dtype}|" in n["fingerprint"]]
    assert len(found) == 1, status["namespaces"]
    return found[0]


def test_engine_a_with_kvtier_answers_like_vllm_alone_and_offloads_every_full_chunk(runs):
    """A miss costs nothing in correctness: A's tokens equal the reference, and
    each prefix's full chunks reach the pool once."""
    assert runs["a"]["tokens"] == runs["ref"]["tokens"]
    assert runs["a"]["metrics"]["vllm:kv_offload_store_bytes"] > 0
    ns = _ns(runs["status_after_other"], "bfloat16")
    assert ns["blocks"] >= 2 * (PREFIX_TOKENS // 32)


def test_an_engine_with_no_daemon_at_its_socket_answers_like_vllm_alone(runs):
    """No daemon: the engine starts and serves as if kvtier were absent - no
    load, no store, the reference's tokens."""
    nd = runs["no_daemon"]
    assert nd["tokens"] == runs["ref"]["tokens"]
    assert nd["metrics"].get("vllm:kv_offload_load_bytes", 0) == 0
    assert nd["metrics"].get("vllm:external_prefix_cache_hits", 0) == 0


def test_engine_b_loads_the_prefix_from_kvtier_and_answers_identically(runs):
    """B (a new process) loads A's prefix instead of prefilling it: hits show in
    vLLM's own counters and in ``kvtier status --json``, and its tokens equal
    the reference run without kvtier, including after the daemon was killed."""
    b = runs["b"]
    assert b["tokens"] == runs["ref"]["tokens"]
    assert b["metrics"]["vllm:external_prefix_cache_hits"] >= PREFIX_TOKENS - 32
    assert b["metrics"]["vllm:kv_offload_load_bytes"] > 0
    mid = runs["status_mid_b"]
    assert _ns(mid, "bfloat16")["hits"] >= PREFIX_TOKENS // 32
    names = [c["name"] for c in mid["clients"]]
    assert any(n.startswith("vllm-worker0-") for n in names), names
    assert any(n.startswith("vllm-scheduler-") for n in names), names
    assert all(c["namespaces"] for c in mid["clients"] if c["name"].startswith("vllm-")), mid["clients"]


def test_an_engine_in_another_namespace_gets_no_hits(runs):
    """Same model, other dtype: different bytes, so a different namespace and 0 hits."""
    other = runs["other"]
    assert other["metrics"]["vllm:external_prefix_cache_hits"] == 0
    assert other["metrics"].get("vllm:kv_offload_load_bytes", 0) == 0
    assert _ns(runs["status_after_other"], "float32")["hits"] == 0


def test_engine_b_survives_the_daemon_being_killed_mid_run(runs):
    """After SIGKILL of the daemon, B's remaining prompts (a prefix it never
    saw) are computed locally with identical tokens: no crash, no hang."""
    half = PROMPTS_PER_PREFIX
    assert runs["b"]["tokens"][half:] == runs["ref"]["tokens"][half:]
    assert len(runs["b"]["tokens"]) == 2 * PROMPTS_PER_PREFIX
