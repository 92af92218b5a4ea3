"""``outbox.downstream.lookup_deadline``: a lookup's own time counts from its start, never past
the lease as held; a lookup the lease leaves too little time for is not asked (None)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from outbox.clock import DbClock
from outbox.downstream import lookup_deadline
from tests.support.gateways import FakeMonotonic

CLAIMED = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def clock_and_mono() -> tuple[DbClock, FakeMonotonic]:
    mono = FakeMonotonic()
    return DbClock(CLAIMED, mono(), mono), mono


def test_a_later_lookup_has_its_whole_time_from_its_own_start() -> None:
    clock, mono = clock_and_mono()
    mono.advance(10.0)  # three earlier lookups took this long
    deadline = lookup_deadline(clock, CLAIMED + timedelta(seconds=15), 1.5, least=1.5)
    assert deadline is not None
    assert deadline.left() == pytest.approx(1.5)
    assert deadline.at == CLAIMED + timedelta(seconds=11.5)


def test_a_lookup_never_runs_past_the_lease() -> None:
    clock, mono = clock_and_mono()
    mono.advance(12.0)
    deadline = lookup_deadline(clock, CLAIMED + timedelta(seconds=15), 10.0, least=2.0)
    assert deadline is not None
    assert deadline.left() == pytest.approx(3.0)
    assert deadline.at == CLAIMED + timedelta(seconds=15)


def test_a_renewed_lease_gives_a_late_lookup_its_time() -> None:
    clock, mono = clock_and_mono()
    mono.advance(14.0)  # past most of the claim's 15 s, renewed to 25 s meanwhile
    assert lookup_deadline(clock, CLAIMED + timedelta(seconds=15), 5.0, least=5.0) is None
    renewed = lookup_deadline(clock, CLAIMED + timedelta(seconds=25), 5.0, least=5.0)
    assert renewed is not None and renewed.left() == pytest.approx(5.0)


@pytest.mark.parametrize(
    ("lease_left", "least"),
    [(1.0, 1.5), (0.0, 0.0), (-5.0, 1.0)],
    ids=["less_than_least", "lease_ends_now", "lease_over"],
)
def test_a_lookup_the_lease_leaves_too_little_time_for_is_not_asked(
    lease_left: float, least: float
) -> None:
    clock, mono = clock_and_mono()
    mono.advance(20.0)
    lease_until = CLAIMED + timedelta(seconds=20 + lease_left)
    assert lookup_deadline(clock, lease_until, 10.0, least=least) is None


def test_a_lost_lease_asks_nothing() -> None:
    clock, _ = clock_and_mono()
    assert lookup_deadline(clock, None, 1.5, least=0.0) is None
