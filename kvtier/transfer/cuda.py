"""CUDA KV caches over CUDA IPC: export on the worker, import on the daemon.

Worker side: ``CudaKVCache(tensors)`` turns the engine's CUDA KV tensors into
specs: the storage's IPC handle (from ``_share_cuda_``), dtype, shape,
stride, storage offset, block dim and the device UUID. The UUID, not the
index, names the GPU because worker and daemon may see different
``CUDA_VISIBLE_DEVICES``; the daemon maps it to its own index.

Daemon side: ``open_cuda_specs`` validates every spec without touching CUDA
(so a CPU-only daemon answers a clean BAD_ARGUMENT), maps the device, imports
each storage once and builds the tensors. The returned ``CudaMapping`` owns
the imported storages: dropping it (with every tensor view) closes the IPC
mapping, which is what lets a dead worker's GPU memory go back.

Nothing here initialises CUDA at import time; the daemon imports this module
only when a client sends a CUDA spec.

Primitives: ``normalize_uuid``, ``device_index(uuid, table)``, ``local_uuids()``,
``check_cuda_spec(spec, i)``, ``export_tensor(t, block_dim)``, ``CudaKVCache``,
``open_cuda_specs(specs, uuids)``, ``CudaMapping``.
"""

from __future__ import annotations

import torch

from .layout import dtype_name
from .shm import SpecError, _is_int, check_geometry, extent_bytes

MAX_HANDLE = 4096  # bytes; a CUDA IPC handle is 64, torch adds a little framing


def normalize_uuid(uuid: str) -> str:
    """``GPU-1a2b...`` (nvidia-smi, CUDA_VISIBLE_DEVICES) and ``1A2B...`` (torch) -> ``1a2b...``."""
    u = str(uuid).strip().lower()
    return u[4:] if u.startswith("gpu-") else u


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
    if not _is_int(offset) or offset < 0:
        raise SpecError(f"tensor {i}: storage_offset must be an int >= 0")
    if not isinstance(ipc, dict):
        raise SpecError(f"tensor {i}: ipc must be a map of the storage's IPC fields")
    for key in ("handle", "ref_handle"):
        if not isinstance(ipc.get(key), bytes) or not 0 < len(ipc[key]) <= MAX_HANDLE:
            raise SpecError(f"tensor {i}: ipc.{key} must be non-empty bytes")
    if not isinstance(ipc.get("event", b""), bytes) or len(ipc.get("event", b"")) > MAX_HANDLE:
        raise SpecError(f"tensor {i}: ipc.event must be bytes")
    for key in ("size", "offset", "ref_offset"):
        if not _is_int(ipc.get(key)) or ipc[key] < 0:
            raise SpecError(f"tensor {i}: ipc.{key} must be an int >= 0")
    es = torch.empty((), dtype=dtype).element_size()
    extent = extent_bytes(shape, stride, es)
    if offset * es + extent > ipc["size"]:
        raise SpecError(f"tensor {i}: bytes [{offset * es}, {offset * es + extent}) outside its "
                        f"storage of {ipc['size']} bytes")
    return {"uuid": uuid, "dtype": dtype, "shape": shape, "stride": stride, "offset": offset,
            "block_dim": block_dim, "ipc": ipc}


def export_tensor(t: torch.Tensor, block_dim: int) -> dict:
    """Worker side: the spec that lets the daemon map ``t`` (t stays owned here)."""
    if t.device.type != "cuda":
        raise ValueError(f"CudaKVCache needs CUDA tensors, got one on {t.device}")
    (_dev, handle, size, offset, ref_handle, ref_offset, event, event_sync) = t.untyped_storage()._share_cuda_()
    return {"kind": "cuda", "device_uuid": normalize_uuid(torch.cuda.get_device_properties(t.device).uuid),
            "dtype": dtype_name(t.dtype), "shape": list(t.shape), "stride": list(t.stride()),
            "storage_offset": t.storage_offset(), "block_dim": block_dim,
            "ipc": {"handle": bytes(handle), "size": int(size), "offset": int(offset),
                    "ref_handle": bytes(ref_handle), "ref_offset": int(ref_offset),
                    "event": bytes(event or b""), "event_sync": bool(event_sync)}}


class CudaKVCache:
    """Client side: the engine's CUDA KV tensors, registered in place.

    The tensors stay owned by the engine; keep this object (and them) alive
    while the cache is registered."""

    def __init__(self, tensors: list[torch.Tensor]):
        tensors = list(tensors)
        if not tensors:
            raise ValueError("CudaKVCache needs at least one tensor")
        devices = {t.device for t in tensors}
        if any(d.type != "cuda" for d in devices) or len(devices) != 1:
            raise ValueError(f"CudaKVCache needs CUDA tensors on one device, got {sorted(map(str, devices))}")
        self.tensors = tensors
        self.device = tensors[0].device

    def specs(self, block_dims: list[int]) -> list[dict]:
        return [export_tensor(t, d) for t, d in zip(self.tensors, block_dims)]

    def close(self) -> None:
        self.tensors = []


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
        raise SpecError("this daemon has no CUDA data path (no CUDA device, or gpu = off); "
                        "register CPU caches (ShmKVCache) instead")
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
