"""HF continuous batching with a CUDA paged cache on kvtier (needs a GPU).

The same tiny random Llama and workloads as ``test_transformers.py``, on
``cuda``: HF's paged cache lives on the GPU and is registered in place over
CUDA IPC; the daemon (``--gpu on``) copies between it and the pinned pool,
fenced on HF's compute stream. Every request's tokens must equal
``model.generate`` on the same GPU; requests preempted under cache pressure
are swapped through kvtier and restored byte-exact; a second process loads
the shared document prefix the first one computed.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import spawn
from tests.integrations.test_transformers import (
    DOCUMENT,
    FIRST_ENGINE,
    MODEL_ID,
    PROMPTS,
    SECOND_ENGINE,
    greedy,
    tight_cache,
    tiny_llama,
)
from tests.transfer.test_cuda import gpu_daemon  # noqa: F401  (fixture)

pytestmark = pytest.mark.gpu


def cuda_llama():
    return tiny_llama().to("cuda")


@pytest.fixture(scope="module")
def reference():
    model = cuda_llama()
    cache: dict[tuple, list[int]] = {}

    def tokens(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            out = model.generate(torch.tensor([prompt], device="cuda"), generation_config=greedy())
            cache[tuple(prompt)] = out[0, len(prompt):].tolist()
        return cache[tuple(prompt)]
    return tokens


def run_cuda_engine(socket: str, prompts: list[list[int]]) -> dict:
    from kvtier.integrations.transformers import KVTierContinuousBatchingManager
    with KVTierContinuousBatchingManager(cuda_llama(), greedy(), tight_cache(), model_id=MODEL_ID,
                                         socket=socket) as cb:
        outputs = cb.generate(prompts, timeout=300)
        # The paged cache (and kvtier's hold on it) exists once the first batch ran.
        assert cb.tier is not None and cb.tier.engine.on_gpu, "kvtier did not attach to the CUDA cache"
    return {"tokens": [o.generated_tokens for o in outputs], "errors": [o.error for o in outputs],
            "counters": cb.counters.as_dict()}


def test_cuda_requests_swapped_under_cache_pressure_come_back_exactly(gpu_daemon, reference):  # noqa: F811
    d = gpu_daemon()
    got = run_cuda_engine(d.socket, PROMPTS)
    assert got["errors"] == [None] * len(PROMPTS)
    assert got["tokens"] == [reference(p) for p in PROMPTS]
    c = got["counters"]
    assert c["offloaded_requests"] > 0 and c["restored_requests"] == c["offloaded_requests"], c
    assert c["soft_resets"] == 0 and c["lost_swaps"] == 0, c
    s = d.stats()
    assert s["gpu"]["enabled"] and s["errors"] == {} and s["swap"]["requests"] == 0


def test_a_second_cuda_process_loads_the_document_the_first_computed(gpu_daemon, reference):  # noqa: F811
    d = gpu_daemon()
    first = run_cuda_engine(d.socket, FIRST_ENGINE)
    proc, queue = spawn(run_cuda_engine, d.socket, SECOND_ENGINE)
    status, second = queue.get(timeout=600)
    proc.join(30)
    assert status == "ok", second
    assert first["tokens"] == [reference(p) for p in FIRST_ENGINE]
    assert second["tokens"] == [reference(p) for p in SECOND_ENGINE]
    b = second["counters"]
    assert b["prefix_hits"] > 0 and b["loaded_tokens"] >= len(DOCUMENT), b
    assert b["computed_tokens"] < first["counters"]["computed_tokens"]
    assert d.stats()["errors"] == {}
