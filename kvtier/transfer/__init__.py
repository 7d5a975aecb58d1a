"""Data path, split by where it runs.

Engine side (imported by workers): ``shm.ShmKVCache``, ``cuda.CudaKVCache``,
``adopt.adopt_tensors`` (move engine-allocated tensors into shared memory),
``events.record_on``. Daemon side: ``mapping.open_specs`` (validate and map
an engine's memory), ``layout.KVLayout`` (block geometry), ``copy.BlockCopier``
(the CPU copy routine), ``worker.CopyWorker``, and the CUDA data path
(``gpu``, ``gpu_copy``, ``pinning``). Shared: ``specs`` (the tensor spec
format), ``runs`` (copy planning).
"""

from .layout import KVLayout
from .mapping import open_specs
from .adopt import adopt_tensors
from .shm import KV_PREFIX, ShmKVCache, tensor_spec
from .specs import DTYPES, SpecError, dtype_name
from .worker import CopyWorker

__all__ = ["DTYPES", "KV_PREFIX", "CopyWorker", "KVLayout", "ShmKVCache", "SpecError", "adopt_tensors",
           "dtype_name", "open_specs", "tensor_spec"]
