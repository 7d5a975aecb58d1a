"""Faults injected into real vLLM engines (loaded by vLLM as the offloading spec).

``FirstLoadLosesAWindowGroup``: kvtier's spec, except that the first load
touching several KV cache groups asks the pool for keys nobody stored in
one sliding-window group, as if that group's chunks were evicted between
vLLM's lookup and its load. That group's load fails, the other groups' do
not. Each injection is appended to the file ``$KVTIER_TEST_FAULTS`` (job id,
group position), so the test knows the fault really happened.

``SyncLoadsFirstLost``: kvtier's spec with vLLM 0.33's sync loads on (a budget
every hit fits in), except that the first load asks the pool for keys nobody
stored, as if they were evicted between lookup and load. The injection is
appended to ``$KVTIER_TEST_FAULTS`` (job id, whether vLLM submitted the load
as expedited, i.e. to be waited for within the step).
"""

from __future__ import annotations

import hashlib
import os

from kvtier.integrations.vllm import KVTierOffloadingSpec
from kvtier.integrations.vllm.pool_spec import KVTierSpecs


class FirstLoadLosesAWindowGroup(KVTierOffloadingSpec):
    def get_worker(self, kv_caches):
        worker = super().get_worker(kv_caches)
        if getattr(worker, "_fault_armed", None) is None:
            worker._fault_armed = True
            submit = worker.submit_load
            windowed = [i for i, w in enumerate(self.windowed) if w]

            def submit_load(job_id, src, dst, *args, **kwargs):
                touched = [i for i, g in enumerate(src.groups) if g]
                lost = [i for i in windowed if i in touched]
                if worker._fault_armed and len(touched) > 1 and lost:
                    worker._fault_armed = False
                    g = lost[0]
                    gone = [hashlib.blake2b(h + b"evicted", digest_size=16).digest() for h in src.groups[g]]
                    src = KVTierSpecs(groups=[gone if i == g else keys for i, keys in enumerate(src.groups)])
                    with open(os.environ["KVTIER_TEST_FAULTS"], "a") as f:
                        f.write(f"{job_id} {g}\n")
                return submit(job_id, src, dst, *args, **kwargs)

            worker.submit_load = submit_load
        return worker


def _lost(hashes: list[bytes]) -> list[bytes]:
    return [hashlib.blake2b(h + b"evicted", digest_size=16).digest() for h in hashes]


class SyncLoadsFirstLost(KVTierOffloadingSpec):
    def __init__(self, config):
        super().__init__(config)
        # vLLM 0.33 reads the budget from the spec's extra config (0.32 ignores it).
        self.extra_config = {**self.extra_config, "sync_load_budget_bytes": 1 << 30}

    def get_worker(self, kv_caches):
        worker = super().get_worker(kv_caches)
        if getattr(worker, "_fault_armed", None) is None:
            worker._fault_armed = True
            submit = worker.submit_load

            def submit_load(job_id, src, dst, expedited=False):
                if worker._fault_armed:
                    worker._fault_armed = False
                    src = KVTierSpecs(groups=[_lost(keys) for keys in src.groups])
                    with open(os.environ["KVTIER_TEST_FAULTS"], "a") as f:
                        f.write(f"{job_id} {'expedited' if expedited else 'async'}\n")
                return submit(job_id, src, dst, expedited=expedited)

            worker.submit_load = submit_load
        return worker
