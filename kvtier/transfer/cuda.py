"""Engine side: CUDA KV caches exported over CUDA IPC.

``CudaKVCache(tensors)`` turns the engine's CUDA KV tensors into specs: the
storage's IPC handle (from ``_share_cuda_``), dtype, shape, stride, storage
offset, block dim and the device UUID. The UUID, not the index, names the
GPU because worker and daemon may see different ``CUDA_VISIBLE_DEVICES``;
the daemon maps it to its own index (``mapping.open_cuda_specs``).

Each storage is shared once, however many tensors view it. Every
``_share_cuda_`` call puts the storage behind a new IPC reference counter
that the receiver must release; the daemon imports a storage once (by
handle) and so releases one counter. Per-layer views of one buffer shared
one by one left the others counting, and PyTorch kept the engine's memory
(in its IPC "limbo") after the engine freed it.

Memory PyTorch cannot share (expandable segments on older torch, a custom
allocator's pool) raises ``CannotShare``, a ``ValueError``: the engine runs
on without kvtier rather than dying of the ``RuntimeError`` underneath.

Nothing here initialises CUDA at import time.

Primitives: ``export_specs(tensors, block_dims, uuid, share)``, ``share_storage(t)``,
``CannotShare``, ``CudaKVCache``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .specs import CannotShare, dtype_name, normalize_uuid


def share_storage(t: torch.Tensor) -> dict:
    """The IPC fields of ``t``'s whole storage (one new reference counter per call)."""
    (_dev, handle, size, offset, ref_handle, ref_offset, event, event_sync) = t.untyped_storage()._share_cuda_()
    return {"handle": bytes(handle), "size": int(size), "offset": int(offset),
            "ref_handle": bytes(ref_handle), "ref_offset": int(ref_offset),
            "event": bytes(event or b""), "event_sync": bool(event_sync)}


def export_specs(tensors: Sequence[torch.Tensor], block_dims: Sequence[int], uuid: str,
                 share: Callable[[torch.Tensor], dict] = share_storage) -> list[dict]:
    """Worker side: the specs that let the daemon map ``tensors`` (they stay owned
    here), calling ``share`` once per distinct storage."""
    shared: dict[int, dict] = {}
    specs = []
    for i, (t, block_dim) in enumerate(zip(tensors, block_dims)):
        key = t.untyped_storage().data_ptr()
        if key not in shared:
            try:
                shared[key] = share(t)
            except RuntimeError as exc:  # e.g. "expandable segments ... not supported for IPC"
                raise CannotShare(f"tensor {i}: PyTorch cannot share this memory over CUDA IPC ({exc}); "
                                  "kvtier needs KV tensors from PyTorch's default CUDA allocator") from exc
        specs.append({"kind": "cuda", "device_uuid": uuid, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                      "stride": list(t.stride()), "storage_offset": t.storage_offset(),
                      "block_dim": block_dim, "ipc": shared[key]})
    return specs


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
        """Raises ``CannotShare`` for memory PyTorch cannot export."""
        uuid = normalize_uuid(torch.cuda.get_device_properties(self.device).uuid)
        return export_specs(self.tensors, block_dims, uuid)

    def close(self) -> None:
        self.tensors = []
