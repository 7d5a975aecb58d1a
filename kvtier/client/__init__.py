"""Engine-side client library.

    from kvtier.client import Client, Namespace, ShmKVCache, CudaKVCache, block_hashes
    from kvtier.client import Connection      # one link, several caches: Client(connection=...)
    from kvtier.client import adopt_tensors   # engine-allocated CPU tensors -> shareable cache
"""

from ..protocol.hashing import block_hashes, chain_hash
from .client import Client
from .connection import Connection
from .errors import DaemonUnavailable, KVTierError
from .handles import TransferHandle, TransferResult
from .namespace import Namespace

__all__ = ["Client", "Connection", "CudaKVCache", "DaemonUnavailable", "KVTierError", "Namespace", "ShmKVCache",
           "TransferHandle", "TransferResult", "adopt_tensors", "block_hashes", "chain_hash"]


def __getattr__(name):  # ShmKVCache needs torch; the CLI must not pay for importing it
    if name == "ShmKVCache":
        from ..transfer.shm import ShmKVCache
        return ShmKVCache
    if name == "adopt_tensors":
        from ..transfer.adopt import adopt_tensors
        return adopt_tensors
    if name == "CudaKVCache":
        from ..transfer.cuda import CudaKVCache
        return CudaKVCache
    raise AttributeError(name)
