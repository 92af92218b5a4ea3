"""The retry decision (``outbox.retry``): by time within the deadline, a budget of attempts
that reached the downstream, a cap, a floor and a ceiling on tries."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from outbox.retry import (
    DEFAULT_CAP_SECONDS,
    RetryAt,
    RetryPolicy,
    Stop,
    next_retry,
    parse_retry_after,
)

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
POLICY = RetryPolicy(cap=30.0)


def decide(**kw: object) -> object:
    args: dict[str, object] = {
        "tries": 1,
        "reached": 0,
        "max_attempts": 5,
        "deadline": NOW + timedelta(seconds=60),
        "now": NOW,
        "policy": POLICY,
        "rand": lambda: 1.0,
    }
    args.update(kw)
    return next_retry(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tries", "ceiling"), [(1, 0.2), (2, 0.4), (3, 0.8), (4, 1.6), (10, 30.0), (500, 30.0)]
)
def test_backoff_is_exponential_and_capped(tries: int, ceiling: float) -> None:
    assert POLICY.backoff_ceiling(tries) == pytest.approx(ceiling)
    got = decide(tries=tries, deadline=NOW + timedelta(hours=1))
    assert got == RetryAt(NOW + timedelta(seconds=ceiling))


def test_the_default_cap_is_minutes() -> None:
    assert RetryPolicy().cap == DEFAULT_CAP_SECONDS == 300.0
    assert RetryPolicy().backoff_ceiling(40) == 300.0


@pytest.mark.parametrize("r", [0.0, 0.25, 0.999])
def test_full_jitter_spreads_the_delay_between_the_floor_and_the_ceiling(r: float) -> None:
    got = decide(tries=3, rand=lambda: r)
    assert got == RetryAt(NOW + timedelta(seconds=0.1 + (0.8 - 0.1) * r))


def test_the_floor_holds_when_the_jitter_draws_nothing() -> None:
    """A downstream refusing at once, and a random draw of 0: still no tight loop."""
    assert decide(tries=1, rand=lambda: 0.0) == RetryAt(NOW + timedelta(seconds=0.1))
    assert decide(retry_after=0.0) == RetryAt(NOW + timedelta(seconds=0.1))


def test_the_attempt_budget_counts_attempts_that_reached_the_downstream() -> None:
    assert decide(tries=40, reached=4) == RetryAt(NOW + timedelta(seconds=30))
    assert decide(tries=5, reached=5) == Stop("attempts_exhausted")


def test_the_ceiling_on_tries_stops_a_retry_that_never_reaches_anything() -> None:
    policy = RetryPolicy(max_tries=12)
    assert isinstance(decide(tries=11, policy=policy, deadline=NOW + timedelta(days=1)), RetryAt)
    got = decide(tries=12, policy=policy, deadline=NOW + timedelta(days=1))
    assert got == Stop("tries_exhausted")


def test_deadline_passed_stops() -> None:
    assert decide(deadline=NOW) == Stop("deadline_passed")
    assert decide(deadline=NOW - timedelta(seconds=1), retry_after=1.0) == Stop("deadline_passed")


def test_a_half_hour_outage_is_waited_out_in_a_few_dozen_tries() -> None:
    now, tries = NOW, 0
    while (now - NOW) < timedelta(minutes=30):
        tries += 1
        got = next_retry(
            tries=tries,
            reached=0,
            max_attempts=5,
            deadline=NOW + timedelta(hours=1),
            now=now,
            rand=lambda: 0.5,
        )
        assert isinstance(got, RetryAt)
        now = got.when
    assert 15 < tries < 40  # ramps up over ~12 tries, then one every ~2.5 min


def test_backoff_never_reaches_the_deadline() -> None:
    got = decide(tries=10, deadline=NOW + timedelta(seconds=3), rand=lambda: 0.5)
    assert got == RetryAt(NOW + timedelta(seconds=0.1 + 2.9 * 0.5))
    # the whole window drawn: it would land on the deadline, where nothing may be sent
    assert decide(tries=10, deadline=NOW + timedelta(seconds=3)) == Stop("deadline_passed")
    # less than the floor left: no room for another try
    assert decide(deadline=NOW + timedelta(seconds=0.05)) == Stop("deadline_passed")


def test_retry_after_inside_the_budget_is_honoured_exactly() -> None:
    assert decide(retry_after=7.0) == RetryAt(NOW + timedelta(seconds=7))
    # beyond the cap too: the downstream asked for it and it fits
    assert decide(retry_after=45.0) == RetryAt(NOW + timedelta(seconds=45))


def test_retry_after_beyond_the_deadline_stops_at_once() -> None:
    assert decide(retry_after=61.0) == Stop("retry_after_past_deadline")
    assert decide(retry_after=60.0) == Stop("retry_after_past_deadline")
    near = NOW + timedelta(seconds=0.05)  # the floor's wait would reach the deadline
    assert decide(retry_after=0.0, deadline=near) == Stop("retry_after_past_deadline")


@given(
    tries=st.integers(1, 2000),
    reached=st.integers(0, 120),
    max_attempts=st.integers(1, 100),
    left=st.floats(-10.0, 86400.0, allow_nan=False),
    cap=st.floats(0.2, 3600.0, allow_nan=False),
    retry_after=st.none() | st.floats(0.0, 7200.0, allow_nan=False),
    r=st.floats(0.0, 1.0, allow_nan=False),
)
def test_a_retry_never_lands_past_the_deadline_nor_outside_floor_and_cap(
    tries: int,
    reached: int,
    max_attempts: int,
    left: float,
    cap: float,
    retry_after: float | None,
    r: float,
) -> None:
    policy = RetryPolicy(cap=cap, max_tries=1000)
    deadline = NOW + timedelta(seconds=left)
    got = next_retry(
        tries=tries,
        reached=reached,
        max_attempts=max_attempts,
        deadline=deadline,
        now=NOW,
        retry_after=retry_after,
        policy=policy,
        rand=lambda: r,
    )
    if reached >= max_attempts:
        assert got == Stop("attempts_exhausted")
    elif tries >= policy.max_tries:
        assert got == Stop("tries_exhausted")
    elif left <= policy.floor:
        assert isinstance(got, Stop)
    if isinstance(got, Stop):
        return
    assert reached < max_attempts and tries < policy.max_tries  # only the reached ones count
    assert NOW < got.when < deadline
    delay = (got.when - NOW).total_seconds()
    assert delay >= policy.floor - 1e-6
    if retry_after is None:
        assert delay <= policy.backoff_ceiling(tries) + 1e-6 <= max(cap, policy.floor) + 1e-6
    else:
        assert delay == pytest.approx(max(policy.floor, retry_after), abs=1e-5)


@given(
    outage=st.floats(0.0, 3000.0, allow_nan=False),
    draws=st.lists(st.floats(0.0, 0.999, allow_nan=False), min_size=1, max_size=50),
)
@example(outage=99.875, draws=[0.0])  # connected at the last try allowed
def test_refused_connections_are_tried_by_time_until_the_outage_ends_or_the_deadline(
    outage: float, draws: list[float]
) -> None:
    """An outage of refused connections (nothing ever reaches the downstream) shorter than
    the deadline costs latency only: tried again until it ends, each retry before the
    deadline; one longer than the deadline stops at it, not at a count of tries."""
    deadline = NOW + timedelta(hours=1)
    policy = RetryPolicy()  # the defaults: base 0.2 s, cap 5 min, 1000 tries
    now, tries = NOW, 0
    while True:
        tries += 1
        if (now - NOW).total_seconds() >= outage:
            break  # this try connects: sent, and done
        got = next_retry(
            tries=tries,
            reached=0,
            max_attempts=5,
            deadline=deadline,
            now=now,
            policy=policy,
            rand=itertools.repeat(draws[tries % len(draws)]).__next__,
        )
        if isinstance(got, Stop):
            if got.reason == "tries_exhausted":  # the draws kept every wait at the floor
                assert tries == policy.max_tries
                return
            assert got.reason == "deadline_passed"
            assert (deadline - now).total_seconds() <= policy.cap
            return
        assert now < got.when < deadline
        now = got.when
    assert (now - NOW).total_seconds() <= outage + policy.cap  # latency: at most one cap late
    # the try that connected may be the last one allowed (draws that keep every wait at the
    # floor: 1000 tries 0.1 s apart outlast an outage of 99.9 s)
    assert tries <= policy.max_tries


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", 0.0),
        ("7", 7.0),
        (" 120 ", 120.0),
        ("Sun, 29 Nov 2026 12:00:30 GMT", 30.0),
        ("Sun, 29 Nov 2026 11:00:00 GMT", 0.0),  # in the past
        ("-5", None),
        ("1.5", None),
        ("soon", None),
        ("", None),
        ("Sun, 99 Nov 2026 12:00:30 GMT", None),
        (None, None),
        ("\u0663", None),  # another script's digit is no number of seconds
        ("\uff11\uff12", None),  # full-width digits
        ("7\n", None),
    ],
)
def test_retry_after_parsing(value: str | None, expected: float | None) -> None:
    assert parse_retry_after(value, NOW) == expected
