"""kvtier as SGLang's HiCache L3 storage (``pip install kvtier[sglang]``).

Every SGLang instance on the node with the same model and page layout shares
one kvtier pool: a prefix one instance wrote back is prefetched, not
recomputed, by the next (another process, a restart, another DP replica).
Load it as SGLang's dynamic storage backend::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "kvtier.integrations.sglang",
            "class_name": "KVTierHiCacheStorage", "interface_v1": 1}'

Where each part runs (every SGLang rank process has its own backend and client):

* ``backend.py`` - ``KVTierHiCacheStorage``: SGLang's ``HiCacheStorage``
  calls (exists / get / set, per page key) on a kvtier ``Client``.
* ``staging.py`` - the sealed buffer pages pass through between SGLang's
  host pool and the daemon, and why the host pool itself cannot be handed over.
* ``naming.py`` - settings, namespace and key derivation (no SGLang import).
"""

# SGLang's factory does ``getattr(import_module(module_path), class_name)``; the
# class is imported on first use (PEP 562), so ``naming`` and ``staging`` import
# without SGLang installed.
_LAZY = {"KVTierHiCacheStorage": ".backend"}

__all__ = ["KVTierHiCacheStorage"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
