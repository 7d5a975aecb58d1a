"""Tenants' turns at the remote tier, without a store (kvtier/remote/turns.py): probe
slots are bounded per tenant and in all, queues serve tenants in round robin while
each tenant's own jobs keep their order, and a stop marker ends the queue only once
what was queued before it has been taken."""

from __future__ import annotations

import queue
import threading

import pytest

from kvtier.remote.jobs import Job
from kvtier.remote.turns import Slots, TurnQueue


def job(tenant: str, n: int) -> Job:
    return Job("fetch", (tenant, n), None, [], tenant=tenant)


def test_a_tenant_holds_at_most_its_slots_and_others_still_get_theirs():
    s = Slots(total=5, per_tenant=2)
    assert [s.take("beta") for _ in range(4)] == ["", "", "tenant", "tenant"]
    assert [s.take("alpha") for _ in range(3)] == ["", "", "tenant"]
    assert s.take("gamma") == "" and s.take("delta") == "full"  # the whole pool is a bound too
    s.give("beta")
    assert s.take("beta") == "" and s.held == 5
    for t in ("alpha", "alpha", "beta", "beta", "gamma"):
        s.give(t)
    assert s.held == 0 and not s.of  # no entry left behind per tenant


def test_tenants_take_turns_and_each_keeps_its_own_order():
    q = TurnQueue()
    for n in range(5):
        q.put(job("beta", n))
    q.put(job("alpha", 0))
    q.put(job("alpha", 1))
    q.put(job("gamma", 0))
    order = [q.get_nowait().token for _ in range(q.qsize())]
    assert order == [("beta", 0), ("alpha", 0), ("gamma", 0), ("beta", 1), ("alpha", 1), ("beta", 2),
                     ("beta", 3), ("beta", 4)]


def test_an_empty_queue_times_out_and_a_stop_comes_after_what_was_queued():
    q = TurnQueue()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.01)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    q.put(job("beta", 0))
    q.put(None)
    q.put(job("alpha", 0))  # put after the marker: still taken before the queue ends
    assert {q.get().token, q.get().token} == {("beta", 0), ("alpha", 0)}
    assert q.get() is None and q.get_nowait() is None


def test_a_waiting_consumer_is_woken_by_a_put():
    q = TurnQueue()
    got = []
    t = threading.Thread(target=lambda: got.append(q.get(timeout=30)))
    t.start()
    q.put(job("alpha", 7))
    t.join(30)
    assert [j.token for j in got] == [("alpha", 7)]
