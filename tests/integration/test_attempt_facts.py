"""``operation_facts``: what the reconciler dates a "not found" by is read from the attempts as
they were written. Each attempt was on the wire until the *earlier* of its lease's end and its
outcome's time (no send outlives its lease; an outcome written means the request was over),
and the newest attempt is the one that started last. On PostgreSQL and SQLite."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import update

from outbox.models import Attempt
from outbox.storage.attempts import operation_facts
from tests.support.rig import Rig

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def _second_attempt(rig: Rig, op_id: int, **times: datetime | None) -> None:
    (first,) = rig.attempts(op_id)
    with rig.sessions.begin() as s:
        s.add(
            Attempt(
                operation_id=op_id,
                number=2,
                lease_version=first.lease_version,
                worker="w2",
                **times,
            )
        )


def _facts(rig: Rig, op_id: int) -> tuple[list[tuple[datetime, datetime | None]], datetime]:
    with rig.sessions() as s:
        facts = operation_facts(s, op_id)
    assert facts.last_sent_at is not None
    sends = sorted(
        (start.astimezone(UTC), end and end.astimezone(UTC)) for start, end in facts.sends
    )
    return sends, facts.last_sent_at.astimezone(UTC)


def test_each_attempt_ends_at_the_earlier_of_its_lease_end_and_its_outcome(rig: Rig) -> None:
    rig.judged_by_ledger = False  # attempts written by hand, nothing sent
    op_id = rig.enqueue()
    rig.start_send(op_id)
    with rig.sessions.begin() as s:  # answered 10 s into a 60 s lease
        s.execute(
            update(Attempt)
            .where(Attempt.operation_id == op_id)
            .values(
                started_at=T0,
                not_after=T0 + timedelta(seconds=60),
                finished_at=T0 + timedelta(seconds=10),
            )
        )
    # its outcome written 30 s after its lease had ended (a paused worker): the lease bounds it
    _second_attempt(
        rig,
        op_id,
        started_at=T0 + timedelta(seconds=100),
        not_after=T0 + timedelta(seconds=160),
        finished_at=T0 + timedelta(seconds=190),
    )
    sends, last = _facts(rig, op_id)
    assert sends == [
        (T0, T0 + timedelta(seconds=10)),
        (T0 + timedelta(seconds=100), T0 + timedelta(seconds=160)),
    ]
    assert last == T0 + timedelta(seconds=100)  # the newest attempt's start, not the first's


def test_an_attempt_with_one_bound_ends_at_it_and_with_none_is_unbounded(rig: Rig) -> None:
    rig.judged_by_ledger = False
    op_id = rig.enqueue()
    rig.start_send(op_id)
    with rig.sessions.begin() as s:  # in flight: its lease end only
        s.execute(
            update(Attempt)
            .where(Attempt.operation_id == op_id)
            .values(started_at=T0, not_after=T0 + timedelta(seconds=60), finished_at=None)
        )
    _second_attempt(rig, op_id, started_at=T0 + timedelta(seconds=5), not_after=None)
    sends, last = _facts(rig, op_id)
    assert sends == [(T0, T0 + timedelta(seconds=60)), (T0 + timedelta(seconds=5), None)]
    assert last == T0 + timedelta(seconds=5)
