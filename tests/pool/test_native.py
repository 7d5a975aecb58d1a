"""The compiled index (kvtier/pool/_native.c): a KeyMap is a dict of entries, byte for byte
the same answers; what it refuses; what it costs in memory; and the pure-Python fallback."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import sysconfig
import tracemalloc

import pytest

from kvtier.pool.entry import NATIVE, PURE_PYTHON_ASKED, READY, WRITING, Entry, new_map

from .kit import chain, key

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
native = pytest.mark.skipif(not NATIVE, reason="the compiled index (kvtier/pool/_native.c) is not built")


def test_the_compiled_index_is_built_wherever_a_c_compiler_and_pythons_headers_are():
    if PURE_PYTHON_ASKED:
        pytest.skip("KVTIER_PURE_PYTHON asks for the pure-Python index")
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if not (shutil.which("cc") or shutil.which("gcc")) or not headers:
        pytest.skip("no C compiler or no Python headers here: the pure-Python index is the right one")
    assert NATIVE, "pip install -e . found a compiler and headers but kvtier/pool/_native.c is not built"


@native
def test_a_keymap_answers_as_a_dict_does_through_twenty_thousand_random_operations():
    rng = random.Random(7)
    pool = [Entry(None, key("k", i), i * 4096) for i in range(3000)]  # few keys: runs collide and shift back
    m, d = new_map(), {}
    for step in range(20000):
        e = rng.choice(pool)
        op = rng.random()
        if op < 0.45:
            m[e.key] = e
            d[e.key] = e
        elif op < 0.75:
            assert m.pop(e.key, None) is d.pop(e.key, None)
        elif op < 0.8 and d:
            k, v = m.popitem()
            assert d.pop(k) is v and v.key == k
        else:
            assert m.get(e.key) is d.get(e.key) and (e.key in m) == (e.key in d)
        assert len(m) == len(d) and bool(m) == bool(d)
        if step % 2000 == 0:
            assert sorted(m) == sorted(d) and {k: v for k, v in m.items()} == d
            assert m.get_many(list(d)[:50]) == list(d.values())[:50]
    while d:  # popitem empties it exactly
        k, v = m.popitem()
        assert d.pop(k) is v
    assert len(m) == 0 and not m and list(m) == []
    with pytest.raises(KeyError):
        m.popitem()


@native
def test_a_keymap_refuses_what_is_not_a_16_byte_key_or_not_its_own_entry():
    m = new_map()
    e = Entry(None, key("a"), 0)
    m[e.key] = e
    assert m.get(b"short") is None and b"short" not in m and m.get(e.key + b"x") is None
    with pytest.raises(KeyError):
        _ = m[b"short"]
    with pytest.raises(TypeError):
        m.get("a str")
    with pytest.raises(TypeError):
        m[key("b")] = "not an entry"
    with pytest.raises(ValueError):
        m[key("b")] = e  # an entry goes under its own key only
    with pytest.raises(ValueError):
        m[b"x" * 15] = e
    with pytest.raises(KeyError):
        m.fetch([e.key, key("absent")])
    with pytest.raises(KeyError):
        del m[key("absent")]
    assert m.fetch([e.key]) == [e] and len(m) == 1  # nothing it refused changed it


@native
def test_an_entry_keeps_what_it_was_given_and_refuses_what_it_cannot_hold():
    ns = object()
    e = Entry(ns, key("a"), (1 << 44) - 1)
    assert (e.ns, e.key, e.offset, e.state, e.pins, e.lp, e.ln) == (ns, key("a"), (1 << 44) - 1, WRITING, 0, None, None)
    e.state = READY
    e.pins = 3
    assert e.state is READY and e.pins == 3 and e.offset == (1 << 44) - 1  # fields packed in one word
    with pytest.raises(ValueError):
        e.state = "gone"
    with pytest.raises(OverflowError):
        Entry(ns, key("b"), 1 << 44)  # past 16 TiB
    with pytest.raises(ValueError):
        Entry(ns, b"short", 0)
    with pytest.raises(AttributeError):
        e.colour = "red"  # no attribute beyond the index's own
    assert e.state is READY and e.pins == 3


@native
def test_each_process_hashes_keys_under_its_own_random_key():
    # A tenant who knew the table's hash could send block hashes that all land in one probe
    # run. The table's order (popitem's) differs between two processes for the same keys.
    code = ("from kvtier.pool.entry import Entry, new_map\n"
            "import hashlib\n"
            "m = new_map()\n"
            "for i in range(64):\n"
            "    k = hashlib.blake2b(str(i).encode(), digest_size=16).digest(); m[k] = Entry(None, k, 0)\n"
            "print(b''.join(m.popitem()[0] for _ in range(64)).hex())\n")
    env = dict(os.environ, PYTHONPATH=REPO)
    orders = {subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True).stdout for _ in range(3)}
    assert len(orders) == 3


@native
def test_a_block_in_the_compiled_index_costs_under_100_bytes_of_heap():
    n = 200_000
    keys = chain("mem", n)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        m = new_map()
        for i, k in enumerate(keys):
            m[k] = Entry(None, k, i * 4096)
        per = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert len(m) == n and m.get(keys[-1]).offset == (n - 1) * 4096
    # 64 B the entry, 8 B per table slot at a load of 0.375-0.75 (here 0.76 -> 0.38 just after doubling)
    assert per < 100, f"{per:.0f} B per block"


def test_kvtier_pure_python_runs_the_same_index_without_the_compiled_one():
    code = ("from kvtier.pool.entry import NATIVE, new_map\n"
            "from kvtier.pool import BlockIndex, SlabAllocator\n"
            "idx = BlockIndex(SlabAllocator(1 << 20, 1 << 16))\n"
            "ns = idx.namespace('t\\x1fm', 4096)\n"
            "keys = [bytes([i]) * 16 for i in range(8)]\n"
            "idx.complete_store(idx.prepare_store(ns, keys))\n"
            "print(NATIVE, new_map is dict, idx.lookup(ns, keys))\n")
    env = dict(os.environ, PYTHONPATH=REPO, KVTIER_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "8"]


@native
def test_a_load_that_would_pin_a_block_past_its_limit_is_refused_whole():
    from kvtier.pool.entry import PIN_MAX
    from kvtier.pool.index import PinLimit

    from .kit import BLOCK_A, make_index, stored
    idx = make_index()
    ns = idx.namespace("model-a", BLOCK_A)
    keys = chain("p", 2)
    assert stored(idx, ns, keys) == 2
    with pytest.raises(PinLimit):
        idx.prepare_load(ns, [keys[0]] + [keys[1]] * (PIN_MAX + 1))
    assert [e.pins for e in idx.ready_entries(ns, keys)] == [0, 0]  # nothing was pinned, not even keys[0]
    plan = idx.prepare_load(ns, [keys[1]] * PIN_MAX)  # up to the limit is fine
    assert idx.ready_entry(ns, keys[1]).pins == PIN_MAX
    idx.complete_load(plan)
    idx.check_integrity()
