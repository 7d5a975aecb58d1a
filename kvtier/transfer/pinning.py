"""Pin the daemon's shared-memory pool for DMA, in chunks, in the background.

``cudaHostRegister`` costs about 0.1 s per GB and one call of >= 512 GiB fails
on recent drivers, so the pool is registered chunk by chunk (default 16 GiB)
on a background thread while the daemon keeps answering. Copies issued before
their chunk is pinned are still correct (CUDA stages pageable memory), only
slower; the gather-kernel path waits for the whole pool.

For the kernel path the pinned pool also gets a device view: a CUDA tensor
whose data pointer is the host address (with unified addressing the device
address of registered memory equals the host address; checked with the
driver before use, never assumed). It is built through DLPack so torch takes
the device we name instead of inferring one from the pointer.

Primitives: ``chunk_ranges(base, size, chunk)``, ``PinnedPool(pool, chunk)``
with ``start``/``pinned_bytes``/``pinning``/``device_view(dev)``/``close``,
``dlpack_view(ptr, nbytes, device_type, device_id)``.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

log = logging.getLogger("kvtier.pinning")
REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
DL_CPU, DL_CUDA = 1, 2


def chunk_ranges(base: int, size: int, chunk: int) -> list[tuple[int, int]]:
    """(address, length) pieces of ``[base, base + size)``, each <= ``chunk``."""
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    return [(base + off, min(chunk, size - off)) for off in range(0, size, chunk)]


class PinnedPool:
    def __init__(self, pool: torch.Tensor, chunk: int, progress=None):
        self.base, self.size, self.chunk = pool.data_ptr(), pool.numel(), chunk
        self.progress = progress
        self.pinned_bytes = 0
        self.error = ""
        self._registered: list[int] = []
        self._views: dict[int, torch.Tensor | None] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-pin", daemon=True)

    @property
    def pinning(self) -> bool:
        return self._thread.is_alive()

    @property
    def complete(self) -> bool:
        return self.pinned_bytes == self.size

    def start(self) -> None:
        torch.cuda.init()  # on this thread, before the worker thread calls the runtime
        self._thread.start()

    def _run(self) -> None:
        cudart = torch.cuda.cudart()
        for addr, n in chunk_ranges(self.base, self.size, self.chunk):
            if self._stop.is_set():
                return
            rc = int(cudart.cudaHostRegister(addr, n, REGISTER_FLAGS))
            if rc != 0:
                self.error = (f"cudaHostRegister of {n} bytes at pool offset {addr - self.base} "
                              f"failed (cudaError {rc}); the rest of the pool stays pageable")
                log.error("%s", self.error)
                return
            self._registered.append(addr)
            self.pinned_bytes += n
            if self.progress is not None:
                self.progress(self.pinned_bytes, self.size)
        log.info("pinned the whole pool (%d bytes) in %d chunks", self.size, len(self._registered))

    def device_view(self, device: int) -> torch.Tensor | None:
        """uint8 CUDA tensor over the pinned pool for ``device``, or None (not
        pinned yet, or the device cannot address host memory at its host address)."""
        if not self.complete:
            return None
        with self._lock:
            if device not in self._views:
                self._views[device] = self._make_view(device)
            return self._views[device]

    def view_devices(self) -> list[int]:
        """Devices whose gather kernels can address the pool (views built so far)."""
        with self._lock:
            return sorted(d for d, v in self._views.items() if v is not None)

    def _make_view(self, device: int) -> torch.Tensor | None:
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # the primary context is current on this thread now
            dptr = _host_device_pointer(self.base)
        if dptr != self.base:
            log.warning("device %d maps the pool at %s, not at its host address: gather kernels off",
                        device, hex(dptr) if dptr else "an unknown address")
            return None
        try:
            return dlpack_view(self.base, self.size, DL_CUDA, device)
        except Exception as exc:
            log.warning("no device view of the pool on device %d (%s): gather kernels off", device, exc)
            return None

    def close(self) -> None:
        """Stop pinning and unregister every chunk (before the pool is unmapped)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            self._views.clear()
        if self._registered:
            cudart = torch.cuda.cudart()
            for addr in self._registered:
                cudart.cudaHostUnregister(addr)
        self._registered = []
        self.pinned_bytes = 0


def _host_device_pointer(ptr: int) -> int | None:
    """The device address of registered host memory per the driver, or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuMemHostGetDevicePointer_v2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    out = ctypes.c_uint64(0)
    return out.value if fn(ctypes.byref(out), ctypes.c_void_p(ptr), 0) == 0 else None


# ---- DLPack by hand: a tensor over memory we own, on the device we name ------------------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


_keep: dict[int, tuple] = {}  # managed structs torch still points at, by address


@_DELETER
def _release(addr):
    _keep.pop(addr, None)


def dlpack_view(ptr: int, nbytes: int, device_type: int, device_id: int) -> torch.Tensor:
    """A 1-d uint8 tensor aliasing ``[ptr, ptr + nbytes)``; the memory must
    outlive it (the pool does: views are dropped before unpinning/unmapping)."""
    shape = (ctypes.c_int64 * 1)(nbytes)
    strides = (ctypes.c_int64 * 1)(1)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(ctypes.c_void_p(ptr), _DLDevice(device_type, device_id), 1,
                                  _DLDataType(1, 8, 1), shape, strides, 0)  # code 1 = uint
    managed.deleter = _release
    addr = ctypes.addressof(managed)
    _keep[addr] = (managed, shape, strides)
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = new_capsule(addr, b"dltensor", None)
    return torch.utils.dlpack.from_dlpack(capsule)
