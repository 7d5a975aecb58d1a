"""kvtier as vLLM's KV offloading tier.

Load it with::

    kv_transfer_config = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KVTierOffloadingSpec",
            "spec_module_path": "kvtier.integrations.vllm",
        },
    }

Where each part runs (three processes touch it, each with its own kvtier client):

* ``connector.py`` - ``KVTierConnector``: vLLM's ``OffloadingConnector`` plus
  what it lacks for a shared tier: batched lookups and failed loads reported
  to the scheduler (which then recomputes).
* ``spec.py`` - ``KVTierOffloadingSpec``: builds the two sides below.
* ``manager.py`` - scheduler side (engine core): lookups, no data.
* ``events.py`` - scheduler side: kvtier's chunks on vLLM's KV event stream.
* ``worker.py`` - worker side: adopts vLLM's CPU KV tensors into shared
  memory and asks the daemon to copy blocks.
* ``naming.py`` - namespace and key derivation (no vLLM import).
* ``groups.py`` - a model's KV cache groups (hybrid models: one namespace
  per group) and one job split by group (no vLLM import).
"""

# vLLM's two entry points are loaded on first use (PEP 562): vLLM finds them with
# ``getattr(import_module(path), name)``, which this serves, while importing the
# vLLM-free submodules (``naming``, ``groups``, ``slices``) never imports vLLM: a
# GPU node without vLLM still collects and runs the tests that use them.
_LAZY = {"KVTierConnector": ".connector", "KVTierOffloadingSpec": ".spec"}

__all__ = ["KVTierConnector", "KVTierOffloadingSpec"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
