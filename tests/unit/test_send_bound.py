"""The send bound (``SendsBatches.send_deadline``): an attempt must be over by the operation's
deadline or its lease's end *less* the clock margin, whichever is first, in database time. The
margin is what lets the reconciler trust the downstream's refusal of a late request at the
lease's end (reconciler/decide.py, ``quiet_at``). Written to kill mutants the mutation suite let
through (docs/mutation.md)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from outbox.clock import DbClock
from workers.sending import SendsBatches

DB_AT = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
MARGIN = 2.0


def _bound(lease_in: float, deadline_in: float) -> datetime:
    claimed = SimpleNamespace(
        lease_until=DB_AT + timedelta(seconds=lease_in),
        deadline=DB_AT + timedelta(seconds=deadline_in),
    )
    sender = SimpleNamespace(clock_margin=MARGIN)
    clock = DbClock(DB_AT, 100.0, monotonic=lambda: 100.0)
    deadline = SendsBatches.send_deadline(sender, claimed, clock)  # type: ignore[arg-type]
    assert deadline.expires == 100.0 + (deadline.at - DB_AT).total_seconds()
    return deadline.at


@pytest.mark.parametrize("lease_in", [10.0, 30.0, 60.0])
def test_the_lease_bounds_the_send_less_the_clock_margin(lease_in: float) -> None:
    assert _bound(lease_in, deadline_in=3600) == DB_AT + timedelta(seconds=lease_in - MARGIN)


def test_the_operations_deadline_bounds_it_when_it_comes_first() -> None:
    assert _bound(60, deadline_in=30) == DB_AT + timedelta(seconds=30)
    # within the margin of the lease's end, the margin still wins
    assert _bound(60, deadline_in=59) == DB_AT + timedelta(seconds=58)
