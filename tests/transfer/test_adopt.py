"""Engine-allocated CPU tensors move into sealed shared memory in place.

Integrations (vLLM, transformers) register memory the engine allocated:
``adopt_tensors`` keeps each tensor object, its dtype, shape, strides and
contents, and only swaps its storage for a sealed memfd the daemon can be
handed.
"""

from __future__ import annotations

import fcntl
import os

import pytest
import torch

from kvtier.client import adopt_tensors
from kvtier.transfer.shm import SEALS


def test_adopted_tensors_keep_identity_contents_and_geometry():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 2, 4, 16, generator=g).half()
    b = torch.randn(2, 8, 4, 16, generator=g).to(torch.bfloat16)
    c = torch.randn(16, 8, generator=g).t()  # non-contiguous strides
    before = [t.clone() for t in (a, b, c)]
    geometry = [(t.dtype, t.shape, t.stride()) for t in (a, b, c)]
    kv = adopt_tensors([a, b, c])
    assert kv.tensors[0] is a and kv.tensors[1] is b and kv.tensors[2] is c
    assert [(t.dtype, t.shape, t.stride()) for t in (a, b, c)] == geometry
    assert all(x.equal(y) for x, y in zip((a, b, c), before))
    fd = kv.fds()[0]
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    # The engine's own tensor now writes the shared memory the daemon maps.
    a[3].fill_(7)
    mapped = torch.frombuffer(kv.memory.mmap, dtype=torch.uint8)
    assert mapped[kv.offsets[0]:kv.offsets[0] + a.numel() * 2].view(torch.float16).view(a.shape)[3].eq(7).all()
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    kv.close()
    assert a[3].eq(7).all()  # the tensors outlive the descriptor


def test_adopt_refuses_what_it_cannot_share():
    with pytest.raises(ValueError, match="at least one"):
        adopt_tensors([])
    with pytest.raises(ValueError, match="CPU tensors"):
        adopt_tensors([torch.zeros(2, device="meta")])
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        adopt_tensors([torch.zeros(2, dtype=torch.complex64)])


def test_adopted_tensors_round_trip_through_the_daemon(daemon):
    from kvtier.client import Client
    from tests.helpers import NS
    g = torch.Generator().manual_seed(3)
    layers = [torch.randn(32, 2, 16, 2, 32, generator=g).half() for _ in range(4)]  # engine-allocated
    kv = adopt_tensors(layers)
    hashes = [bytes([0x77, i]) * 8 for i in range(4)]
    with Client(daemon.socket) as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(hashes, [0, 1, 2, 3]).wait().ok
        want = [t[:4].clone() for t in layers]
        for t in layers:
            t[8:12].zero_()
        assert c.load(hashes, [8, 9, 10, 11]).wait().ok
    assert all(w.equal(t[8:12]) for w, t in zip(want, layers))
