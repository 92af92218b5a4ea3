"""A process's database outage said in two lines (``outbox.outage``): which errors are an
unreachable database, the first failure's line with what waits, the counts in between, the
line when it answers again. A real database's outage: tests/integration/test_database_outage.py.
"""

from __future__ import annotations

import logging

import pytest
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError

from outbox.outage import DatabaseOutage, database_away

REFUSED = OperationalError("connect", None, Exception("connection refused"))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "outbox.outage"]


@pytest.mark.parametrize(
    ("error", "away"),
    [
        (REFUSED, True),
        (InterfaceError("SELECT", None, Exception("closed"), connection_invalidated=True), True),
        (IntegrityError("UPDATE", None, Exception("value refused")), False),
        (RuntimeError("a bug"), False),
    ],
    ids=["operational", "connection_invalidated", "refused_value", "bug"],
)
def test_only_an_unreachable_database_is_away(error: Exception, away: bool) -> None:
    assert database_away(error) is away
    assert DatabaseOutage().away(error) is away


def test_an_outage_is_one_line_when_it_starts_and_one_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    outage = DatabaseOutage(monotonic=clock)
    with caplog.at_level(logging.INFO):
        outage.back()  # no outage: nothing to say
        assert outage.away(REFUSED, waiting=3)
        for _ in range(20):
            clock.now += 1
            outage.away(REFUSED, skipped=1)
        outage.away(REFUSED, waiting=2)
        outage.gave_up(2)  # left to the reconciler: not retried
        clock.now += 0.44
        outage.back()
        outage.back()
    assert lines(caplog) == [
        "database unreachable; retrying (3 writes waiting)",
        "database reachable again after 20.4 s; 3 writes retried, 20 tasks skipped meanwhile",
    ]
    last = [r for r in caplog.records if r.name == "outbox.outage"][-1]
    assert (last.outage_seconds, last.retried, last.skipped) == (20.4, 3, 20)  # type: ignore[attr-defined]


def test_a_second_outage_counts_afresh(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    outage = DatabaseOutage(monotonic=clock)
    outage.away(REFUSED, waiting=5)
    outage.back()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        outage.away(REFUSED, skipped=1)
        clock.now += 2
        outage.back()
    assert lines(caplog) == [
        "database unreachable; retrying (1 task skipped)",
        "database reachable again after 2 s; 0 writes retried, 1 task skipped meanwhile",
    ]


def test_an_error_that_is_not_an_outage_is_neither_counted_nor_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outage = DatabaseOutage()
    with caplog.at_level(logging.INFO):
        assert not outage.away(IntegrityError("UPDATE", None, Exception("no")), waiting=1)
        outage.back()
    assert lines(caplog) == []
