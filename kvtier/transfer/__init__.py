"""Data path, split by where it runs.

Engine side (imported by workers): ``shm.ShmKVCache``, ``shm.adopt_tensors``, ``cuda.CudaKVCache``,
``events.record_on``. Daemon side: ``mapping.open_specs`` (validate and map
an engine's memory), ``layout.KVLayout`` (block geometry and the CPU copy
routine), ``worker.CopyWorker``, and the CUDA data path (``gpu``, ``pinning``,
``copier``, ``runs``). Shared: ``specs`` (the tensor spec format).
"""

from .layout import KVLayout
from .mapping import open_specs
from .shm import KV_PREFIX, ShmKVCache, adopt_tensors, tensor_spec
from .specs import DTYPES, SpecError, dtype_name
from .worker import CopyWorker

__all__ = ["DTYPES", "KV_PREFIX", "CopyWorker", "KVLayout", "ShmKVCache", "SpecError", "adopt_tensors",
           "dtype_name", "open_specs", "tensor_spec"]
