"""pytest plugin: vLLM's own offloading tests with kvtier's connector in place of vLLM's.

Loaded (``-p kvtier_vllm_contract``) into a pytest run over the test files of
vLLM's source distribution (``tests/integrations/test_vllm_contract.py``
fetches them). Before vLLM's test modules are imported it points the names
they use at kvtier's classes:

* ``OffloadingConnector`` (the class, and the registry entry the factory
  resolves ``kv_connector="OffloadingConnector"`` through) -> ``KVTierConnector``;
* ``OffloadingConnectorWorker`` -> ``KVTierConnectorWorker``.

Both are subclasses, so vLLM's ``isinstance`` checks still hold, and every
test that builds a connector (by class or by name) now builds kvtier's. The
spec stays whatever the test chose (mostly vLLM's mock spec): the contract
under test is that ``KVTierConnector`` is a drop-in ``OffloadingConnector``
for any spec, not only kvtier's.
"""

from __future__ import annotations

import os


def pytest_configure(config):
    from vllm.distributed.kv_transfer.kv_connector import factory
    from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import worker

    from kvtier.integrations.vllm import KVTierConnector
    from kvtier.integrations.vllm.connector import KVTierConnectorWorker

    offloading_connector.OffloadingConnector = KVTierConnector
    worker.OffloadingConnectorWorker = KVTierConnectorWorker
    factory.KVConnectorFactory._registry["OffloadingConnector"] = lambda: KVTierConnector
    # Proof for the driving test that vLLM's tests will build kvtier's classes.
    built = factory.KVConnectorFactory.get_connector_class_by_name("OffloadingConnector")
    proof = os.environ.get("KVTIER_CONTRACT_PROOF")
    if proof:
        with open(proof, "w") as f:
            f.write(f"{built.__module__}.{built.__qualname__}\n{worker.OffloadingConnectorWorker.__qualname__}\n")


def pytest_report_header(config):
    return "kvtier: OffloadingConnector -> kvtier.integrations.vllm.KVTierConnector"
