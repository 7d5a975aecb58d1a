"""The disk tier's write scheduling without threads or files: tenants take turns
in the write backlog, the backlog stays bounded with the longest one paying,
and reads and writes wait in lanes of their own."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.disk.schedule import BATCH, Adopted, IOQueues, WriteBacklog
from kvtier.pool.keys import SEP

BLOCK = 1000


@dataclass(eq=False)
class Ns:
    key: str
    block_bytes: int = BLOCK


@dataclass
class E:  # an adopted index entry: its bucket and hash
    ns: Ns
    key: bytes


def keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(4, "little") for i in range(n)]


def drain(b: WriteBacklog, room: int = 10**9) -> list[tuple[str, int]]:
    """(tenant, blocks) of each turn until the backlog is empty."""
    turns = []
    while (t := b.take(room)) is not None:
        turns.append((t[0], len(t[2])))
    assert b.problems() == []
    return turns


def test_a_long_backlog_delays_another_tenants_blocks_by_one_batch_per_turn():
    """The attacker has 10,000 blocks waiting when the victim commits 64: the
    victim's blocks go out in the second and fourth turns, not after 10,000."""
    b = WriteBacklog(10**9)
    b.add("attacker", Ns(f"attacker{SEP}m"), keys(1, 10_000))
    b.add("victim", Ns(f"victim{SEP}m"), keys(2, 64))
    turns = drain(b)
    assert turns[:5] == [("attacker", BATCH), ("victim", BATCH), ("attacker", BATCH), ("victim", BATCH),
                         ("attacker", BATCH)]
    assert sum(n for t, n in turns if t == "attacker") == 10_000 and b.blocks == 0


def test_the_backlog_is_bounded_and_the_longest_one_pays():
    """A 100-block bound: the attacker's flood of 1,000 loses its own oldest 910
    blocks (counted ``backlog_full``); the victim's 10 all stay."""
    b = WriteBacklog(100 * BLOCK)
    b.add("victim", Ns(f"victim{SEP}m"), keys(2, 10))
    b.add("attacker", Ns(f"attacker{SEP}m"), keys(1, 1_000))
    assert (b.blocks, b.of("victim"), b.of("attacker")) == (100, 10, 90)
    assert b.not_written() == {"attacker": {"backlog_full": 910}}
    assert b.not_written("victim") == {}  # a tenant sees only its own
    turns = drain(b)
    assert sum(n for t, n in turns if t == "victim") == 10


def test_a_block_named_twice_waits_once_and_a_flush_forgets_without_counting_a_loss():
    b = WriteBacklog(10**9)
    ns, other = Ns(f"t{SEP}a"), Ns(f"t{SEP}b")
    b.add("t", ns, keys(1, 8))
    b.add("t", ns, keys(1, 8))
    b.add("t", other, keys(2, 4))
    assert b.blocks == 12
    assert b.forget(ns.key) == 8
    assert b.blocks == 4 and b.not_written() == {} and b.problems() == []


def test_a_turn_waits_for_room_and_never_mixes_namespaces():
    b = WriteBacklog(10**9)
    b.add("t", Ns(f"t{SEP}a"), keys(1, 3))
    b.add("t", Ns(f"t{SEP}b", 4 * BLOCK), keys(2, 3))
    assert b.take(BLOCK - 1) is None  # no room for one block: nothing overtakes it
    tenant, ns, got = b.take(10 * BLOCK)
    assert ns.key == f"t{SEP}a" and len(got) == 3
    tenant, ns, got = b.take(9 * BLOCK)  # room for two of the larger blocks
    assert ns.block_bytes == 4 * BLOCK and len(got) == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 3), st.integers(1, 50)), max_size=40),
       st.integers(1, 300))
def test_any_sequence_of_adds_keeps_the_bound_and_every_block_is_written_or_counted(adds, limit):
    b = WriteBacklog(limit * BLOCK)
    named = set()
    for tenant, nsi, n in adds:
        ns = Ns(f"{tenant}{SEP}{nsi}")
        b.add(tenant, ns, keys(nsi, n))
        named.update((ns.key, k) for k in keys(nsi, n))
        assert b.nbytes <= limit * BLOCK and b.problems() == []
    taken = sum(n for _, n in drain(b))
    lost = sum(n for whys in b.not_written().values() for n in whys.values())
    assert taken + lost >= len(named)  # a block dropped and named again counts in both: never silently gone


@dataclass(eq=False)
class Job:
    kind: str
    items: list = field(default_factory=lambda: [0] * 1000)
    next: int = 0


def test_reads_and_writes_wait_in_lanes_of_their_own_and_the_urgent_writer_helps_only_when_asked():
    q = IOQueues()
    q.push(Job("write"))
    q.push(Job("read"))
    q.push(Job("unlink", [0, 1]))
    assert q.take("read")[0].kind == "read"  # a stream of reads never takes a writer's turn
    assert q.take("write")[0].kind == "write"
    assert q.take("urgent") is None  # the backlog is not filling: the urgent writer waits
    q.urgent = True
    assert q.take("urgent")[0].kind == "write"
    q.writes.popleft()
    assert [q.take("write")[0].kind for _ in range(2)] == ["unlink", "unlink"] and q.take("write") is None


def test_the_urgent_writer_starts_at_half_the_backlog_bound_and_stops_below_a_quarter():
    b = WriteBacklog(limit_bytes=8 * 100)
    ns = Ns("a", 100)
    b.add("t", ns, [bytes([i]) for i in range(4)])
    assert not b.urgent(False)  # half: not yet
    b.add("t", ns, [b"x"])
    assert b.urgent(False) and b.urgent(True)
    b.take(100 * 3)
    assert b.urgent(True) is False  # 2 of 8 left: a quarter


def test_adopted_blocks_are_pulled_oldest_namespace_first_in_batches_and_a_flush_forgets_them():
    """A warm restart's kept blocks wait per namespace, in commit order, and leave in batches
    of at most n; a flushed namespace's blocks leave uncounted; nothing is pulled twice."""
    a, b = Ns(f"t{SEP}a"), Ns(f"t{SEP}b")
    waiting = Adopted()
    assert waiting.add([E(ns=a, key=b"a%d" % i) for i in range(5)] + [E(ns=b, key=b"b%d" % i) for i in range(3)]) == 8
    assert waiting.pull(0) == [] and waiting.left == 8
    assert waiting.pull(4) == [(a, [b"a0", b"a1", b"a2", b"a3"])]
    assert waiting.pull(4) == [(a, [b"a4"]), (b, [b"b0", b"b1", b"b2"])]
    assert waiting.left == 0 and waiting.pull(4) == []
    waiting.add([E(ns=a, key=b"x"), E(ns=b, key=b"y")])
    waiting.forget({b.key})
    assert waiting.counts() == [(a, 1)] and waiting.left == 1
    waiting.forget(None)
    assert waiting.left == 0 and waiting.counts() == []
