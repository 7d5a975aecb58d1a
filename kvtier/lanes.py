"""Round-robin lanes: items queued per owner, taken one owner at a time.

An owner's items keep their order; after an owner's item is taken the owner
goes to the back of the round (if it has more), so one owner's hundred items
delay another owner's next item by one, not by a hundred. Used by the daemon's
copy worker (owners: clients) and the remote tier's queues (owners: tenants).
Not locked: callers hold their own lock.

Primitives: ``Lanes()``, ``.push(owner, item)``, ``.push_front(owner, item)``
(back first in its owner's lane, the owner last in the round if it had no lane),
``.pop() -> (owner, item)`` (IndexError when empty), ``len()``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any


class Lanes:
    def __init__(self):
        self._lanes: OrderedDict[Any, deque] = OrderedDict()  # owner -> its items; the first is next
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, owner: Any, item: Any) -> None:
        self._lanes.setdefault(owner, deque()).append(item)
        self._count += 1

    def push_front(self, owner: Any, item: Any) -> None:
        lane = self._lanes.get(owner)
        if lane is None:
            self._lanes[owner] = deque([item])  # a new key: last in the round
        else:
            lane.appendleft(item)
        self._count += 1

    def pop(self) -> tuple[Any, Any]:
        if not self._count:
            raise IndexError("no item in any lane")
        owner, lane = next(iter(self._lanes.items()))
        item = lane.popleft()
        self._count -= 1
        if lane:
            self._lanes.move_to_end(owner)  # its next item after every other owner's turn
        else:
            del self._lanes[owner]
        return owner, item
