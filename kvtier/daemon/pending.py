"""A load a lower tier serves: checked once at the dispatch point, held by the
tier while it reads (disk) or fetches (remote) the blocks the pool lacks, then
handed back to the load path that asked - never re-encoded and dispatched again.

The request handler builds one for a load when a lower tier is on and asks the
tiers in order (disk, then remote), each at most once; a tier that takes it
calls ``land()`` when its blocks are in the pool (or its wait ended, or the
client cancelled: ``cancel()`` first), and ``resume`` - the handler's - goes on
with the next tier, then copies from RAM, or answers every block failed when
cancelled. ``land()`` runs ``resume`` once per tier that held the load (the
handler marks it ``held`` when a tier takes it), however often that tier calls it.

Primitives: ``PendingLoad(identity, req_id, msg, keys, checked, uid, resume)``,
``.count``, ``.prefix``, ``.cancel()``, ``.cancelled``, ``.held``, ``.land()``, ``.next_tier``.
"""

from __future__ import annotations

from typing import Callable


class PendingLoad:
    __slots__ = ("identity", "req_id", "msg", "keys", "checked", "uid", "next_tier", "cancelled", "held",
                 "_resume")

    def __init__(self, identity: bytes, req_id: int, msg, keys: list[bytes], checked: tuple, uid,
                 resume: Callable[["PendingLoad"], None]):
        self.identity, self.req_id, self.msg, self.keys = identity, req_id, msg, keys
        self.checked = checked  # LoadOp.check's (fence, engine ids): not checked again on resume
        self.uid = uid          # the requesting user: a waiting load counts toward its transfer cap
        self.next_tier = 0      # the tiers before it have been asked
        self.cancelled = self.held = False  # held: a tier has it and has not landed it yet
        self._resume = resume

    @property
    def count(self) -> int:
        return len(self.keys)

    @property
    def prefix(self) -> bool:
        """Lookup-and-load: only the chain's ready prefix is wanted."""
        return bool(self.msg.prefix)

    def cancel(self) -> None:
        """The client cancelled: the load is answered failed, nothing copied (the engine may reuse its blocks)."""
        self.cancelled = True

    def land(self) -> None:
        """The tier holding this load is done with it: back to the load path, once per tier."""
        if self.held:
            self.held = False
            self._resume(self)
