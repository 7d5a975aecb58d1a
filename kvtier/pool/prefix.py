"""The longest READY prefix of a hash chain, exactly, in few Python steps."""

from __future__ import annotations

from itertools import takewhile

from .shardmap import fetch


def ready_prefix(ready, keys: list) -> list:
    """Entries of the longest prefix of ``keys`` found in ``ready`` (a dict or a ``ShardedMap``).

    Bisection finds L with keys[L - 1] ready and keys[L] not (log2(n) probes;
    a hash chain whose suffixes are evicted first is ready up to one point),
    then one C-level pass fetches keys[:L] and so proves them all ready: the
    answer is exact for any keys. Only if that proof fails (a hole inside the
    prefix: a discarded block, or keys that are not one chain) does it fall
    back to a walk, in C too.
    """
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi) // 2
        if keys[mid] in ready:
            lo = mid + 1
        else:
            hi = mid
    try:
        return fetch(ready, keys[:lo])
    except KeyError:
        return list(map(ready.__getitem__, takewhile(ready.__contains__, keys)))
