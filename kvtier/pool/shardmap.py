"""A large namespace's ready map in shards, so no insert rebuilds the whole of it.

CPython rebuilds a dict's table in one call when its insert slots run out:
at each doubling while it grows and, at a steady size, about every as many
inserts as it holds (a deleted key's slot comes back only with a rebuild).
A namespace's ready map at 2M blocks under churn (one block evicted, one
stored) held the loop 139 ms in one insert every ~1M inserts, and a rebuild
grows with the map (BENCHMARKS.md 18.12).

A map starts as a plain dict, so namespaces up to ``SPLIT_AT`` entries pay
nothing: shards cost every op a Python call per key, which made the public
trace's replay with 560k-block namespaces 9-10% slower (BENCHMARKS.md 18.12),
so they start where one dict's rebuild would exceed a 1M-entry one's (~70 ms),
the one-time split costing about one such rebuild. Past it the index swaps in
a ``ShardedMap`` (``grown``): ``SHARDS``
dicts, a key's shard chosen by its hash. Python's hash of bytes is keyed per
process (SipHash, a random seed), so a tenant cannot aim its keys at one
shard (with ``PYTHONHASHSEED`` fixed in the daemon's environment it could, in
its own namespace: that shard then rebuilds like one dict, as without shards),
and it is computed once per key object and cached, which the shard's own
lookup then reuses. Each shard rebuilds on its own, at 1/``SHARDS`` of
the map: at 32M entries in one namespace a rebuild is ~125k entries.

It keeps the dict API the index uses (``get``, ``in``, ``[]``, ``pop``,
``popitem``, ``update``, ``len``, iteration); ``popitem`` takes from the last
shard that has entries (a flush frees hidden maps with it, in no particular
order: nothing sees a hidden map). ``len`` sums the shards (256 calls): the
hot paths never ask it.

Primitives: ``ShardedMap(pairs=(), make=dict)`` (``.get_many(keys)``, ``.fetch(keys)``), ``grown(m) -> m or a
ShardedMap``, ``get_many(m, keys)``, ``fetch(m, keys)`` (either kind of map), ``SPLIT_AT``, ``SHARDS``.
"""

from __future__ import annotations

from typing import Iterable, Iterator

SHARDS = 256
MASK = SHARDS - 1
SPLIT_AT = 1 << 20  # a plain dict up to here (a rebuild of it ~70 ms): shards cost a 2M-block replay 9-10% (18.12)
_NONE = object()


class ShardedMap:
    __slots__ = ("_s", "_last")

    def __init__(self, pairs: Iterable = (), make=dict):
        """``make``: the shards' type (a dict, or the index's ``entry.new_map`` for its entries)."""
        self._s = [make() for _ in range(SHARDS)]
        self._last = MASK  # popitem's first shard to look in
        self.update(pairs)

    def get(self, key, default=None):
        return self._s[hash(key) & MASK].get(key, default)

    def __contains__(self, key) -> bool:
        return key in self._s[hash(key) & MASK]

    def __getitem__(self, key):
        return self._s[hash(key) & MASK][key]

    def __setitem__(self, key, value) -> None:
        self._s[hash(key) & MASK][key] = value

    def __delitem__(self, key) -> None:
        del self._s[hash(key) & MASK][key]

    def pop(self, key, default=_NONE):
        shard = self._s[hash(key) & MASK]
        return shard.pop(key) if default is _NONE else shard.pop(key, default)

    def popitem(self) -> tuple:
        """A (key, value) taken out, from the last shard holding any; KeyError when empty."""
        s = self._s
        for i in range(self._last, self._last - SHARDS, -1):  # wraps: inserts may land anywhere
            if s[i]:
                self._last = i % SHARDS
                return s[i].popitem()
        raise KeyError("popitem(): the map is empty")

    def update(self, pairs) -> None:
        s = self._s
        for key, value in (pairs.items() if hasattr(pairs, "items") else pairs):
            s[hash(key) & MASK][key] = value

    def __len__(self) -> int:
        return sum(map(len, self._s))

    def __bool__(self) -> bool:
        return any(self._s)

    def __iter__(self) -> Iterator:
        for shard in self._s:
            yield from shard

    def keys(self) -> Iterator:  # dict.update(a ShardedMap) reads keys() and []
        return iter(self)

    def values(self) -> Iterator:
        for shard in self._s:
            yield from shard.values()

    def items(self) -> Iterator:
        for shard in self._s:
            yield from shard.items()

    # Many keys in one call (the hot paths): no Python call per key, ~0.1 us per key.
    def get_many(self, keys) -> list:
        s = self._s
        return [s[hash(k) & MASK].get(k) for k in keys]

    def fetch(self, keys) -> list:
        """Each key's value; KeyError at the first key absent."""
        s = self._s
        return [s[hash(k) & MASK][k] for k in keys]

    def largest_shard(self) -> int:
        return max(map(len, self._s))


def get_many(m, keys) -> list:
    """``[m.get(k) for k in keys]`` for a map of ``entry.new_map`` or a ShardedMap, at C speed
    (a ``KeyMap`` and a ShardedMap have the method; a dict goes through ``map``)."""
    return list(map(m.get, keys)) if type(m) is dict else m.get_many(keys)


def fetch(m, keys) -> list:
    """``[m[k] for k in keys]`` (KeyError at the first absent key) for either kind of map."""
    return list(map(m.__getitem__, keys)) if type(m) is dict else m.fetch(keys)


def grown(m):
    """``m`` itself, or once one map (``entry.new_map``) holds more than ``SPLIT_AT`` entries,
    the same entries in a ``ShardedMap`` (the caller stores it in place of ``m``)."""
    if type(m) is not ShardedMap and len(m) > SPLIT_AT:
        return ShardedMap(m, type(m))
    return m
