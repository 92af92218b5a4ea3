from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from outbox.retry import RetryAt, RetryPolicy, Stop, next_retry, parse_retry_after, remaining

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)


def decide(**kw: object) -> object:
    args: dict[str, object] = {
        "attempts_made": 1,
        "max_attempts": 5,
        "deadline": NOW + timedelta(seconds=60),
        "now": NOW,
        "rand": lambda: 1.0,
    }
    args.update(kw)
    return next_retry(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("attempts", "ceiling"), [(1, 0.2), (2, 0.4), (3, 0.8), (4, 1.6), (10, 30.0), (500, 30.0)]
)
def test_backoff_is_exponential_and_capped(attempts: int, ceiling: float) -> None:
    assert RetryPolicy().backoff_ceiling(attempts) == pytest.approx(ceiling)
    got = decide(attempts_made=attempts, max_attempts=1000, deadline=NOW + timedelta(hours=1))
    assert got == RetryAt(NOW + timedelta(seconds=ceiling))


@pytest.mark.parametrize("r", [0.0, 0.25, 0.999])
def test_full_jitter_scales_the_whole_delay(r: float) -> None:
    got = decide(attempts_made=3, rand=lambda: r)
    assert got == RetryAt(NOW + timedelta(seconds=0.8 * r))


def test_attempts_exhausted_stops() -> None:
    assert decide(attempts_made=5) == Stop("attempts_exhausted")


def test_deadline_passed_stops() -> None:
    assert decide(deadline=NOW) == Stop("deadline_passed")


def test_backoff_never_passes_the_deadline() -> None:
    got = decide(attempts_made=10, max_attempts=20, deadline=NOW + timedelta(seconds=3))
    assert got == RetryAt(NOW + timedelta(seconds=3))
    got = decide(
        attempts_made=10, max_attempts=20, deadline=NOW + timedelta(seconds=3), rand=lambda: 0.5
    )
    assert got == RetryAt(NOW + timedelta(seconds=1.5))


def test_retry_after_inside_the_budget_is_honoured_exactly() -> None:
    assert decide(retry_after=7.0) == RetryAt(NOW + timedelta(seconds=7))


def test_retry_after_beyond_the_deadline_stops_at_once() -> None:
    assert decide(retry_after=61.0) == Stop("retry_after_past_deadline")
    assert decide(retry_after=60.0) == Stop("retry_after_past_deadline")


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


def test_remaining_is_never_negative() -> None:
    assert remaining(NOW - timedelta(seconds=5), NOW) == 0.0
    assert remaining(NOW + timedelta(seconds=5), NOW) == 5.0
