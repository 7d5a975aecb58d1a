"""The GPU data path's parts that need no GPU: spec validation, device UUID
mapping, pinning chunks, method choice, the DLPack pool view, the protocol
fields, and a daemon without CUDA refusing CUDA caches cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import weakref

import msgpack
import pytest
import torch

from kvtier.client import CudaKVCache, KVTierError, block_hashes
from kvtier.protocol import messages as m
from kvtier.protocol.codec import decode, encode
from kvtier.protocol.errors import ErrorCode
from kvtier.transfer.cuda import export_specs
from kvtier.transfer.gpu import queue_or_drain
from kvtier.transfer.gpu_copy import MethodChooser
from kvtier.transfer.mapping import check_cuda_spec, device_index, open_cuda_specs, open_specs
from kvtier.transfer.specs import CannotShare, SpecError, normalize_uuid
from kvtier.transfer.pinning import DL_CPU, chunk_ranges, dlpack_view
from kvtier.transfer.worker import CopyWorker
from tests.conftest import REPO
from tests.helpers import NS, make_kv

UUIDS = ["5f0c1a2b-0000-1111-2222-333344445555", "a1b2c3d4-aaaa-bbbb-cccc-ddddeeeeffff"]


def cuda_spec(**over) -> dict:
    """A well-formed CUDA spec as a worker would send it (handles are opaque bytes)."""
    spec = {"kind": "cuda", "device_uuid": "GPU-A1B2C3D4-AAAA-BBBB-CCCC-DDDDEEEEFFFF", "dtype": "float16",
            "shape": [2, 16, 4, 8, 64], "stride": [16 * 4 * 8 * 64, 4 * 8 * 64, 8 * 64, 64, 1],
            "storage_offset": 0, "block_dim": 1,
            "ipc": {"handle": b"\x01" * 64, "size": 2 * 16 * 4 * 8 * 64 * 2, "offset": 0,
                    "ref_handle": b"/torch_1234_5678", "ref_offset": 0, "event": b"\x02" * 64,
                    "event_sync": True}}
    for key, value in over.items():
        if key.startswith("ipc_"):
            spec["ipc"][key[4:]] = value
        else:
            spec[key] = value
    return spec


class SpecsOnly:
    """Stands in for a worker's cache: register_kv_cache only needs ``specs``."""

    def __init__(self, specs):
        self._specs = specs

    def specs(self, block_dims):
        return self._specs


# ---- pure pieces -----------------------------------------------------------------------

def test_device_uuid_maps_to_the_daemons_own_index_whatever_the_spelling():
    # The worker saw this GPU as cuda:0 (its CUDA_VISIBLE_DEVICES); the daemon sees it as 1.
    assert device_index("GPU-A1B2C3D4-AAAA-BBBB-CCCC-DDDDEEEEFFFF", UUIDS) == 1
    assert device_index("5f0c1a2b-0000-1111-2222-333344445555", UUIDS) == 0
    assert normalize_uuid(" GPU-ABC ") == "abc"
    with pytest.raises(SpecError, match="not visible to the daemon"):
        device_index("GPU-ffffffff-0000-0000-0000-000000000000", UUIDS)


def test_a_good_cuda_spec_passes_validation():
    fields = check_cuda_spec(cuda_spec(), 0)
    assert fields["dtype"] is torch.float16 and fields["block_dim"] == 1


@pytest.mark.parametrize("over, why", [
    ({"dtype": "complex64"}, "unsupported dtype"),
    ({"shape": [2, 16]}, "lengths differ"),
    ({"block_dim": 5}, "block_dim"),
    ({"storage_offset": -1}, "storage_offset"),
    ({"device_uuid": 7}, "device_uuid"),
    ({"ipc": "nope"}, "ipc must be a map"),
    ({"ipc_handle": b""}, "ipc.handle"),
    ({"ipc_ref_handle": "str"}, "ipc.ref_handle"),
    ({"ipc_size": 100}, "outside its storage"),          # the view would run past its storage
    ({"storage_offset": 1}, "outside its storage"),
    ({"ipc_offset": True}, "ipc.offset"),
])
def test_bad_cuda_specs_are_rejected_with_the_field_named(over, why):
    with pytest.raises(SpecError, match=why):
        check_cuda_spec(cuda_spec(**over), 3)


def test_a_daemon_without_cuda_rejects_after_validating():
    with pytest.raises(SpecError, match="no CUDA data path"):
        open_cuda_specs([cuda_spec()], None)
    with pytest.raises(SpecError, match="tensor 1: unsupported dtype"):
        open_cuda_specs([cuda_spec(), cuda_spec(dtype="bogus")], None)
    with pytest.raises(SpecError, match="must not mix"):
        open_specs([cuda_spec(), {"kind": "shm"}])


def test_one_registration_is_one_gpu():
    other = cuda_spec(device_uuid=UUIDS[0])
    with pytest.raises(SpecError, match="one GPU"):
        open_cuda_specs([cuda_spec(), other], UUIDS)


def test_cuda_kv_cache_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="CUDA tensors"):
        CudaKVCache([torch.zeros(4, 8)])


def test_each_storage_is_shared_once_however_many_layer_views_it_has():
    """Every ``_share_cuda_`` call adds an IPC reference counter the daemon must
    release; it imports (and releases) each storage once. Per-layer views of
    one buffer must therefore share it once, or the engine's memory stays held."""
    whole, other = torch.zeros(4, 8, 16, dtype=torch.float16), torch.zeros(8, 16, dtype=torch.float16)
    views = [whole[0], whole[1], whole[3], other]
    calls = []

    def share(t):
        calls.append(t.untyped_storage().data_ptr())
        return {"handle": bytes([len(calls)]) * 64, "size": t.untyped_storage().nbytes(), "offset": 0,
                "ref_handle": b"/torch_1_2", "ref_offset": len(calls), "event": b"", "event_sync": False}
    specs = export_specs(views, [0] * 4, UUIDS[0], share=share)
    assert calls == [whole.untyped_storage().data_ptr(), other.untyped_storage().data_ptr()]
    assert [s["ipc"]["ref_offset"] for s in specs] == [1, 1, 1, 2]
    assert [s["storage_offset"] for s in specs] == [0, 8 * 16, 3 * 8 * 16, 0]
    assert all(check_cuda_spec(s, i) for i, s in enumerate(specs))  # what the daemon validates


def test_memory_pytorch_cannot_share_is_a_cannot_share_error_not_a_runtime_error():
    def refuse(t):
        raise RuntimeError("expandable segments are not supported for IPC")
    with pytest.raises(CannotShare, match="tensor 0: PyTorch cannot share this memory") as err:
        export_specs([torch.zeros(4)], [0], UUIDS[0], share=refuse)
    assert isinstance(err.value, ValueError)


def test_a_copy_that_fails_part_way_waits_for_what_it_queued_before_the_error_goes_on():
    """The op is reported failed and its slots or engine blocks reused: copies it
    queued before the failure must have finished by then."""
    events = []

    def queue():
        events.append("copies 1..19 queued")
        raise RuntimeError("CUDA out of memory (copy 20 of 32)")
    with pytest.raises(RuntimeError, match="copy 20 of 32"):
        queue_or_drain(queue, lambda: events.append("stream drained"))
    assert events == ["copies 1..19 queued", "stream drained"]

    def lost():  # a sticky error: the stream cannot even be synchronised
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="copy 20 of 32"):  # the first error is what the caller sees
        queue_or_drain(queue, lost)
    events.clear()
    queue_or_drain(lambda: events.append("all queued"), lambda: events.append("drained"))
    assert events == ["all queued"]  # a good op is not synchronised here (its done event is)


def test_pool_is_pinned_in_chunks_covering_it_exactly():
    ranges = chunk_ranges(4096, 10 * 2**20 + 5, 4 * 2**20)
    assert ranges == [(4096, 4 * 2**20), (4096 + 4 * 2**20, 4 * 2**20), (4096 + 8 * 2**20, 2 * 2**20 + 5)]
    assert chunk_ranges(0, 3, 16) == [(0, 3)]


def test_chooser_measures_each_method_then_keeps_the_faster_per_size():
    c = MethodChooser(trials=2)
    small, big = c.key(True, 16 << 10), c.key(True, 2 << 20)
    assert small != big and c.key(False, 16 << 10) != small  # direction and size both matter
    timings = {small: {"dma": 4.0, "kernel": 1.0}, big: {"dma": 1.0, "kernel": 2.0}}  # seconds per GB
    for key in (small, big):
        tried = []
        for _ in range(4):
            method = c.pick(key)
            tried.append(method)
            c.record(key, method, 10**9, timings[key][method])
        assert sorted(tried) == ["dma", "dma", "kernel", "kernel"]
    assert c.pick(small) == "kernel" and c.pick(big) == "dma"
    assert c.report()[f"store/{16 << 10}"]["kernel"] == 1.0  # GB/s
    assert c.key(True, (16 << 10) + 1) == ("store", 32 << 10)  # buckets round up to powers of two


def test_dlpack_view_aliases_the_memory_it_names():
    # The daemon builds its device view of the pinned pool this way (device CUDA there).
    buf = torch.arange(256, dtype=torch.uint8).repeat(4)
    view = dlpack_view(buf.data_ptr() + 100, 300, DL_CPU, 0)
    assert view.data_ptr() == buf.data_ptr() + 100 and view.numel() == 300
    view[:3] = 7
    assert buf[100:103].tolist() == [7, 7, 7]


def test_event_fields_default_so_old_frames_still_decode():
    old = msgpack.packb(["st", 5, {"reg": 1, "hashes": b"", "blocks": b""}], use_bin_type=True)
    assert decode(old)[1].event == b""
    old_done = msgpack.packb(["done", 5, {"done": 2}], use_bin_type=True)
    assert decode(old_done)[1].event == b""
    for msg in (m.Store(1, b"", b"", b"e" * 64), m.Load(1, b"", b"", 0, b"e" * 64),
                m.TransferDone(1, 0, b"", False, b"d" * 64)):
        assert decode(encode(msg, 9)) == (9, msg)


def test_cpu_installs_never_import_the_cuda_modules():
    code = ("import sys, kvtier.daemon.server, kvtier.client, kvtier.cli;"
            "from kvtier.transfer.mapping import open_specs;"
            "bad = [n for n in ('kvtier.transfer.cuda', 'kvtier.transfer.gpu', 'kvtier.transfer.pinning')"
            " if n in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": REPO})


def test_finished_copy_jobs_let_go_of_what_they_captured():
    # A job's closure holds the registration's tensors; for CUDA caches those keep
    # a gone client's GPU memory mapped, so the worker must not keep the last job.
    class Tensors:
        pass

    held = Tensors()
    ref = weakref.ref(held)
    worker = CopyWorker()
    try:
        worker.submit("job", lambda held=held: None)
        del held
        assert worker.drain(5)
        assert [tok for tok, _ in worker.completed()] == ["job"]
        deadline = time.monotonic() + 2
        while ref() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ref() is None, "the copy thread still references a finished job"
    finally:
        worker.close()


# ---- a real daemon without a CUDA data path ----------------------------------------------

@pytest.fixture
def cpu_daemon(daemon_factory):
    return daemon_factory(process=True, env={"KVTIER_GPU": "off"})


def test_cpu_daemon_refuses_cuda_caches_with_no_gpu_and_keeps_serving(cpu_daemon):
    with cpu_daemon.client(name="gpu-worker") as c:
        with pytest.raises(KVTierError) as err:
            c.register_kv_cache(SpecsOnly([cuda_spec()]), [1], NS)
        # Its own code: the engine's cache is fine, this daemon cannot copy GPU memory.
        assert err.value.code == ErrorCode.NO_GPU and "no CUDA data path" in err.value.message
        assert err.value.side == "daemon"
        with pytest.raises(KVTierError) as err:
            c.register_kv_cache(SpecsOnly([cuda_spec(ipc_size=10)]), [1], NS)
        assert err.value.code == ErrorCode.BAD_ARGUMENT and "outside its storage" in err.value.message
        # The same connection then registers a CPU cache and round-trips a block.
        kv = make_kv(seed=3)
        try:
            c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
            h = block_hashes(list(range(16)), 16)
            assert c.store(h, [5]).wait().done == 1
            want = [t[5].clone() for t in kv.tensors]
            assert c.load(h, [9]).wait().ok
            assert all(torch.equal(t[9], w) for t, w in zip(kv.tensors, want))
        finally:
            kv.close()
    s = cpu_daemon.stats()
    assert (s["errors"]["NO_GPU"], s["errors"]["BAD_ARGUMENT"]) == (1, 1)
    assert (s["pool"]["pinned_bytes"], s["pool"]["pinning"], s["gpu"]) == (0, False, {"enabled": False})


def test_an_event_on_a_cpu_cache_is_refused_before_anything_is_reserved(cpu_daemon):
    kv = make_kv(seed=4)
    try:
        with cpu_daemon.client() as c:
            c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
            h = block_hashes(list(range(32)), 16)
            r = c.store(h, [1, 2], event=b"\x05" * 64).wait()
            assert r.failed == (0, 1) and "event given for a cache that is not on a GPU" in r.error
            assert c.store(h, [1, 2]).wait().done == 2  # nothing was left half-written
            with pytest.raises(ValueError, match="either event or stream"):
                c.store(h, [1, 2], event=b"x", stream=object())
    finally:
        kv.close()
    ns = cpu_daemon.stats()["namespaces"][0]
    assert (ns["blocks"], ns["writing"]) == (2, 0)


def test_held_blocks_stay_held_until_the_daemon_acknowledges(cpu_daemon):
    kv = make_kv(seed=5)
    try:
        with cpu_daemon.client(heartbeat=False) as c:
            c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
            # Freeze the daemon so the acknowledgement cannot have arrived yet.
            cpu_daemon.proc.send_signal(signal.SIGSTOP)
            try:
                handle = c.store(block_hashes(list(range(32)), 16), [7, 8])
                assert handle.held_blocks == (7, 8)
            finally:
                cpu_daemon.proc.send_signal(signal.SIGCONT)
            assert handle.wait().done == 2
            assert handle.held_blocks == ()
    finally:
        kv.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_on_without_cuda_fails_at_startup(daemon_factory):
    with pytest.raises(RuntimeError, match="no CUDA device"):
        daemon_factory(process=True, extra=["--gpu", "on"])
