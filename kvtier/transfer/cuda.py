"""Engine side: CUDA KV caches exported over CUDA IPC.

``CudaKVCache(tensors)`` turns the engine's CUDA KV tensors into specs: the
storage's IPC handle (from ``_share_cuda_``), dtype, shape, stride, storage
offset, block dim and the device UUID. The UUID, not the index, names the
GPU because worker and daemon may see different ``CUDA_VISIBLE_DEVICES``;
the daemon maps it to its own index (``mapping.open_cuda_specs``).

Nothing here initialises CUDA at import time.

Primitives: ``export_tensor(t, block_dim)``, ``CudaKVCache``.
"""

from __future__ import annotations

import torch

from .specs import dtype_name, normalize_uuid


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
