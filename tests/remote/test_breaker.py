"""The circuit breaker opens after consecutive failures, lets one trial through
per cooldown, and closes on the trial's success. Sans-IO: time is passed in."""

from __future__ import annotations

from kvtier.remote.breaker import CLOSED, HALF_OPEN, OPEN, Breaker


def test_consecutive_failures_open_it_and_a_success_in_between_resets_the_count():
    b = Breaker(failures=3, cooldown=1.0)
    b.failure(0.0)
    b.failure(0.0)
    b.success()
    b.failure(0.0)
    b.failure(0.0)
    assert b.state == CLOSED and b.allow(0.0)
    b.failure(0.0)
    assert b.state == OPEN and not b.allow(0.5)


def test_after_the_cooldown_exactly_one_trial_goes_out_and_its_success_closes_it():
    b = Breaker(failures=1, cooldown=1.0)
    b.failure(10.0)
    assert not b.allow(10.9)
    assert b.allow(11.0) and b.state == HALF_OPEN
    assert not b.allow(11.0)  # the trial is out; others still answer locally
    b.success()
    assert b.state == CLOSED and b.allow(11.0)


def test_a_failed_trial_reopens_with_a_longer_cooldown_up_to_the_cap():
    b = Breaker(failures=1, cooldown=1.0, max_cooldown=3.0)
    b.failure(0.0)
    now = 0.0
    waits = []
    for _ in range(4):
        while not b.allow(now):
            now += 0.5
        waits.append(b.cooldown)
        b.failure(now)
    assert waits == [1.0, 2.0, 3.0, 3.0] and b.state == OPEN and b.opened == 5
