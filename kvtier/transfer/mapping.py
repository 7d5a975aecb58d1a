"""Daemon side: validate an engine's tensor specs and map its memory.

``open_specs`` checks every spec before touching memory (a bad spec is the
client's fault: ``SpecError``), then maps the memory the engine handed over
as file descriptors (``fd``: checked for seals and size first, see
``FdMapping``; memory is never opened by a name a client sends) or imports CUDA IPC storages (``cuda``, imported only when such a spec
arrives, so CPU daemons never load CUDA code). The returned mappings own the
memory: dropping them, with every tensor view, unmaps it.

Primitives: ``open_specs(specs, fds, max_tensors, gpu_uuids)``, ``FdMapping``, ``OutOfResources``,
``open_cuda_specs``, ``check_cuda_spec``, ``device_index``, ``local_uuids``, ``CudaMapping``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import stat
import weakref

import numpy as np
import torch

from .specs import NoCudaPath, SpecError, check_geometry, extent_bytes, is_int, normalize_uuid

MAX_HANDLE = 4096  # bytes; a CUDA IPC handle is 64, torch adds a little framing
RESOURCE_ERRNOS = (errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EAGAIN)


class OutOfResources(SpecError):
    """The daemon could not map valid memory: out of memory mappings
    (``vm.max_map_count``) or memory. Not the request's fault."""


def open_specs(specs: list, fds: list[int] = (), max_tensors: int = 4096,
               gpu_uuids: list[str] | None = None) -> tuple[list, list[int], list]:
    """Daemon side: map each handed-over descriptor once and build the tensors.

    ``fds`` are the descriptors the engine handed over (SCM_RIGHTS); a spec's
    ``fd`` is an index into them. The caller keeps ownership of ``fds`` (the
    mappings do not need them once made). CUDA specs go to
    ``open_cuda_specs`` (imported only then, so CPU daemons never load CUDA
    code); ``gpu_uuids`` is the daemon's device table, None without a CUDA
    data path. One registration uses one kind."""
    if not isinstance(specs, list) or not 0 < len(specs) <= max_tensors:
        raise SpecError(f"tensors must be a list of 1..{max_tensors} specs")
    kinds = {s.get("kind") if isinstance(s, dict) else None for s in specs}
    if "cuda" in kinds:
        if kinds != {"cuda"}:
            raise SpecError("a registration must not mix cuda and CPU tensors")
        return open_cuda_specs(specs, gpu_uuids, max_tensors)
    mappings: dict[int, FdMapping] = {}
    tensors, dims = [], []
    base = None
    try:
        for i, spec in enumerate(specs):
            index, offset, dtype, shape, stride, block_dim = _check(spec, i)
            if index >= len(fds):
                raise SpecError(f"tensor {i}: fd {index} was not handed over "
                                f"({len(fds)} descriptors came with this registration)")
            if index not in mappings:
                mappings[index] = FdMapping(fds[index], f"tensor {i}")
            seg = mappings[index]
            es = torch.empty((), dtype=dtype).element_size()
            extent = extent_bytes(shape, stride, es)
            if offset % es or offset + extent > seg.size:
                raise SpecError(f"tensor {i}: bytes [{offset}, {offset + extent}) outside "
                                f"memory of {seg.size} bytes or misaligned")
            base = torch.frombuffer(seg.buffer, dtype=torch.uint8)
            count = (seg.size - offset) // es
            tensors.append(base[offset:offset + count * es].view(dtype).as_strided(shape, stride))
            dims.append(block_dim)
    except BaseException:
        tensors.clear()
        base = None  # the last view: memory cannot be unmapped under it
        for seg in mappings.values():
            seg.close()
        raise
    return tensors, dims, list(mappings.values())


REQUIRED_SEALS = fcntl.F_SEAL_SHRINK
"""Without it the owner could truncate the memory under the daemon's mapping,
and the daemon's next copy would die of SIGBUS."""


class FdMapping:
    """Daemon side: an engine's memory, mapped from a handed-over descriptor.

    Mapped only if it cannot hurt the daemon: a sealed shared-memory file
    (``F_SEAL_SHRINK``: nobody can truncate it, so no access past its end
    can fault) whose pages are all allocated already (reading a sparse file
    would allocate pages charged to the daemon).

    The mapping keeps no descriptor: Python's ``mmap`` holds a ``dup()`` of
    its file for its whole life, which made every mapped hand-over cost the
    daemon descriptors until one user exhausted them. Here ``mmap(2)`` is
    called directly and the memory is exposed as a numpy array; tensors
    built on it keep the array alive, and the last reference to go unmaps
    (``close`` only drops this object's, so it never unmaps under a view)."""

    def __init__(self, fd: int, what: str):
        try:
            st = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:  # EINVAL: not a memfd/tmpfs file, nothing can seal it
            raise SpecError(f"{what}: the descriptor is not sealable shared memory ({exc.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise SpecError(f"{what}: the descriptor is not a memory file")
        if seals & REQUIRED_SEALS != REQUIRED_SEALS:
            raise SpecError(f"{what}: memory must be sealed against shrinking (F_SEAL_SHRINK)")
        if not 0 < st.st_size <= MAX_MAPPING:
            raise SpecError(f"{what}: memory of {st.st_size} bytes (must be 1..{MAX_MAPPING})")
        if st.st_blocks * 512 < st.st_size:
            raise SpecError(f"{what}: memory is sparse ({st.st_blocks * 512} of {st.st_size} bytes "
                            "allocated); allocate it fully (posix_fallocate) before handing it over")
        self._mmap = map_shared(fd, st.st_size, what)
        self.size = st.st_size
        self.name = f"fd memory ({st.st_size} bytes, inode {st.st_ino})"

    @property
    def buffer(self):
        return self._mmap

    def close(self, unlink: bool = False) -> None:
        self._mmap = None  # unmapped once the last tensor view is gone too


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapped:
    """One ``mmap(2)``'d region, seen by numpy through the array interface;
    it carries the finalizer that unmaps it (``map_shared``)."""
    __slots__ = ("__array_interface__", "__weakref__")

    def __init__(self, addr: int, size: int):
        self.__array_interface__ = {"data": (addr, False), "shape": (size,), "typestr": "|u1", "version": 3}


def map_shared(fd: int, size: int, what: str) -> np.ndarray:
    """``size`` bytes of ``fd`` mapped shared read/write, as a uint8 array
    that unmaps itself when the last view of it dies; no descriptor kept.

    Not a ctypes array: ``c_ubyte * size`` makes a new type per size, and a
    type is a reference cycle, freed only by a full garbage collection; one
    that lived through one is frozen (daemon/tenure.py) and would never be."""
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        if err in RESOURCE_ERRNOS:  # the daemon's limits, not the request's fault
            raise OutOfResources(f"{what}: cannot map the memory: {os.strerror(err)}")
        raise SpecError(f"{what}: cannot map the memory: {os.strerror(err)}")  # e.g. a read-only descriptor
    region = _Mapped(addr, size)
    weakref.finalize(region, _libc.munmap, addr, size)
    return np.asarray(region)  # its base is the region: the last view to go unmaps


MAX_MAPPING = 1 << 42


def _check(spec, i):
    if not isinstance(spec, dict) or spec.get("kind") != "fd":
        raise SpecError(f"tensor {i}: expected a CPU tensor spec of kind 'fd' "
                        "(memory is handed over as a descriptor, never named)")
    index, offset = spec.get("fd"), spec.get("offset")
    if not is_int(index) or not 0 <= index < 64:
        raise SpecError(f"tensor {i}: fd must be the index of a handed-over descriptor (0..63)")
    if not is_int(offset) or offset < 0:
        raise SpecError(f"tensor {i}: offset must be an int >= 0")
    return (index, offset, *check_geometry(spec, i))


def device_index(uuid: str, table: list[str]) -> int:
    """Local index of the device with ``uuid`` in ``table`` (local UUIDs by index)."""
    want = normalize_uuid(uuid)
    for i, u in enumerate(table):
        if normalize_uuid(u) == want:
            return i
    raise SpecError(f"GPU {uuid} is not visible to the daemon (it sees {len(table)} devices; "
                    "check the daemon's CUDA_VISIBLE_DEVICES)")


def local_uuids() -> list[str]:
    return [normalize_uuid(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def check_cuda_spec(spec, i: int) -> dict:
    """Validate one CUDA spec (pure: no CUDA needed); returns its fields."""
    if not isinstance(spec, dict) or spec.get("kind") != "cuda":
        raise SpecError(f"tensor {i}: expected a cuda tensor spec")
    ipc, uuid, offset = spec.get("ipc"), spec.get("device_uuid"), spec.get("storage_offset")
    if not isinstance(uuid, str) or not 0 < len(uuid) <= 128:
        raise SpecError(f"tensor {i}: device_uuid must be a device UUID string")
    dtype, shape, stride, block_dim = check_geometry(spec, i)
    if not is_int(offset) or offset < 0:
        raise SpecError(f"tensor {i}: storage_offset must be an int >= 0")
    if not isinstance(ipc, dict):
        raise SpecError(f"tensor {i}: ipc must be a map of the storage's IPC fields")
    for key in ("handle", "ref_handle"):
        if not isinstance(ipc.get(key), bytes) or not 0 < len(ipc[key]) <= MAX_HANDLE:
            raise SpecError(f"tensor {i}: ipc.{key} must be non-empty bytes")
    if not isinstance(ipc.get("event", b""), bytes) or len(ipc.get("event", b"")) > MAX_HANDLE:
        raise SpecError(f"tensor {i}: ipc.event must be bytes")
    for key in ("size", "offset", "ref_offset"):
        if not is_int(ipc.get(key)) or ipc[key] < 0:
            raise SpecError(f"tensor {i}: ipc.{key} must be an int >= 0")
    es = torch.empty((), dtype=dtype).element_size()
    extent = extent_bytes(shape, stride, es)
    if offset * es + extent > ipc["size"]:
        raise SpecError(f"tensor {i}: bytes [{offset * es}, {offset * es + extent}) outside its "
                        f"storage of {ipc['size']} bytes")
    return {"uuid": uuid, "dtype": dtype, "shape": shape, "stride": stride, "offset": offset,
            "block_dim": block_dim, "ipc": ipc}


class CudaMapping:
    """Daemon side: the imported storages of one registration.

    ``gpu_device`` marks a registration as CUDA for the daemon; ``close``
    drops the storages, and once every view is gone too the IPC mapping is
    closed (torch closes it when the last reference to the storage dies)."""

    def __init__(self, device: int, storages: list):
        self.gpu_device = device
        self.name = f"cuda:{device} ({len(storages)} storages)"
        self._storages = storages

    def close(self, unlink: bool = False) -> None:
        self._storages = []


def open_cuda_specs(specs: list, uuids: list[str] | None, max_tensors: int = 4096):
    """Daemon side: ``(tensors, block_dims, [CudaMapping])``. ``uuids`` is the
    daemon's device table, or None when it has no CUDA data path."""
    if not isinstance(specs, list) or not 0 < len(specs) <= max_tensors:
        raise SpecError(f"tensors must be a list of 1..{max_tensors} specs")
    checked = [check_cuda_spec(s, i) for i, s in enumerate(specs)]
    if uuids is None:
        raise NoCudaPath("this daemon has no CUDA data path (no CUDA device, or gpu = off): it cannot "
                         "copy to or from GPU memory; run it on the GPU node with gpu = auto or on, "
                         "or register CPU caches instead")
    devices = {device_index(c["uuid"], uuids) for c in checked}
    if len(devices) != 1:
        raise SpecError("all tensors of one registration must be on one GPU")
    device = devices.pop()
    storages: dict[tuple[bytes, int], object] = {}
    tensors = []
    torch.cuda.init()
    for i, c in enumerate(checked):
        ipc = c["ipc"]
        key = (ipc["handle"], ipc["offset"])
        if key not in storages:
            try:
                storages[key] = torch.UntypedStorage._new_shared_cuda(
                    device, ipc["handle"], ipc["size"], ipc["offset"], ipc["ref_handle"],
                    ipc["ref_offset"], ipc.get("event", b""), bool(ipc.get("event_sync", False)))
            except Exception as exc:  # a stale or foreign handle is the client's problem
                raise SpecError(f"tensor {i}: cannot map its CUDA IPC handle: {exc}") from None
        t = torch.empty(0, dtype=c["dtype"], device=f"cuda:{device}")
        tensors.append(t.set_(storages[key], c["offset"], c["shape"], c["stride"]))
    return tensors, [c["block_dim"] for c in checked], [CudaMapping(device, list(storages.values()))]
