"""What a metrics scrape reads, at a cost that does not grow with the tables.

Each statement is answered from an index (``tests/integration/test_metrics.py`` checks their
plans on PostgreSQL): the partial indexes on live states, the open items' partial unique
index, the events' primary key and the attempts' (operation, number) key. Event counters
advance by primary-key ranges ``(lo, hi]`` of ``operation_events``, and look again for single
ids not yet committed when they were first passed (``settled.metrics``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Integer, Table, and_, bindparam, func, select
from sqlalchemy.orm import Session

from outbox.db import db_now
from outbox.models import (
    Attempt,
    ClockStep,
    DownstreamClockLag,
    Operation,
    OperationEvent,
    ReviewItem,
)
from outbox.states import State

ops: Table = Operation.__table__  # type: ignore[assignment]
events: Table = OperationEvent.__table__  # type: ignore[assignment]
attempts: Table = Attempt.__table__  # type: ignore[assignment]
reviews: Table = ReviewItem.__table__  # type: ignore[assignment]
clock_steps: Table = ClockStep.__table__  # type: ignore[assignment]
lags: Table = DownstreamClockLag.__table__  # type: ignore[assignment]

#: Planned operations: how many, the longest-due one's due time, how many are due (waiting
#: for a worker, not for a later retry), and the database's time.
PLANNED = select(
    func.count(),
    func.min(ops.c.next_attempt_at),
    db_now(),
    func.count().filter(ops.c.next_attempt_at <= db_now()),
).where(ops.c.state == State.PLANNED.value)
UNRESOLVED = (
    select(
        ops.c.state,
        func.count(),
        func.min(ops.c.unknown_since),
        func.min(ops.c.next_attempt_at),
        func.min(ops.c.lease_until),
    )
    .where(ops.c.state.in_([State.SUBMITTED.value, State.UNKNOWN.value]))
    .group_by(ops.c.state)
)
OPEN_REVIEWS = select(func.count()).select_from(reviews).where(reviews.c.resolved_at.is_(None))
LAST_EVENT = select(func.max(events.c.id))
#: The last event written before ``since`` (read backwards from the newest, once per process).
LAST_EVENT_BEFORE = select(func.max(events.c.id)).where(events.c.at < bindparam("since"))

_BY_RECONCILER = events.c.actor.like("reconciler:%")
#: The event that records an attempt's outcome is written in the same statement as the
#: attempt's completion, under the same lease version.
_OUTCOMES = events.join(
    attempts,
    and_(
        attempts.c.operation_id == events.c.operation_id,
        attempts.c.lease_version == events.c.lease_version,
    ),
)
_RECORDS_OUTCOME = and_(events.c.from_state == State.SUBMITTED.value, attempts.c.proof.is_not(None))
_LO, _HI = bindparam("lo", type_=Integer()), bindparam("hi", type_=Integer())
_BETWEEN = and_(events.c.id > _LO, events.c.id <= _HI)
_TRANSITION = (events.c.from_state, events.c.to_state, events.c.reason, _BY_RECONCILER)
_IDS = bindparam("ids", type_=Integer(), expanding=True)

#: Events with ids in ``(lo, hi]`` by transition and by whether the reconciler wrote them.
TRANSITIONS_BETWEEN = select(*_TRANSITION, func.count()).where(_BETWEEN).group_by(*_TRANSITION)
#: Attempts whose outcome an event with id in ``(lo, hi]`` recorded, by proof.
OUTCOMES_BETWEEN = (
    select(attempts.c.proof, func.count())
    .select_from(_OUTCOMES)
    .where(_BETWEEN, _RECORDS_OUTCOME)
    .group_by(attempts.c.proof)
)
_PREVIOUS = func.lag(events.c.id, 1, _LO).over(order_by=events.c.id).label("previous")
_VISIBLE = select(events.c.id, _PREVIOUS).where(_BETWEEN).subquery()
#: ``(before, after)`` around each run of ids in ``(lo, hi]`` with no visible event.
GAPS_BETWEEN = select(_VISIBLE.c.previous, _VISIBLE.c.id).where(
    _VISIBLE.c.id - _VISIBLE.c.previous > 1
)
#: The events ``ids`` (looked for again), by transition.
TRANSITIONS_OF = select(events.c.id, *_TRANSITION).where(events.c.id.in_(_IDS))
#: The attempts' outcomes the events ``ids`` recorded.
OUTCOMES_OF = (
    select(events.c.id, attempts.c.proof)
    .select_from(_OUTCOMES)
    .where(events.c.id.in_(_IDS), _RECORDS_OUTCOME)
)


#: The last step of the database's clock recorded before ``since`` (once per process).
LAST_CLOCK_STEP_BEFORE = select(func.max(clock_steps.c.id)).where(
    clock_steps.c.detected_at < bindparam("since")
)
#: Steps of the database's clock recorded after id ``lo``, by direction (a primary-key range).
CLOCK_STEPS_AFTER = (
    select(clock_steps.c.direction, func.count())
    .where(clock_steps.c.id > _LO)
    .group_by(clock_steps.c.direction)
)

#: The id of the last downstream clock lag row recorded before ``since``.
LAST_LAG_BEFORE = select(func.max(lags.c.id)).where(lags.c.detected_at < bindparam("since"))
#: Episodes of a downstream's clock lag beyond the margin begun after id ``lo`` (a key range).
LAG_EPISODES_AFTER = select(func.count()).where(lags.c.id > _LO, lags.c.begins.is_(True))


@dataclass(frozen=True)
class LiveCounts:
    """The live part of the tables at one moment (``now``, database time)."""

    now: datetime
    planned: int
    #: the longest-due planned operation's due time
    oldest_due: datetime | None
    #: state -> (count, oldest unknown_since, earliest next_attempt_at, earliest lease_until)
    unresolved: dict[str, tuple[int, datetime | None, datetime | None, datetime | None]]
    open_reviews: int
    #: planned operations due now (their next attempt's time has come)
    due: int = 0


def live_counts(session: Session) -> LiveCounts:
    """Operations by live state, their oldest times, and the open review items."""
    planned, oldest_due, now, due = session.execute(PLANNED).one()
    unresolved = {row[0]: tuple(row[1:]) for row in session.execute(UNRESOLVED)}
    return LiveCounts(
        now,
        planned,
        oldest_due,
        unresolved,
        session.scalar(OPEN_REVIEWS) or 0,
        due or 0,
    )


def last_event_id(session: Session) -> int:
    """The newest event's id (0: none)."""
    return session.scalar(LAST_EVENT) or 0


def last_event_id_before(session: Session, since: datetime) -> int:
    """The id of the last event written before ``since`` (0: none)."""
    return session.scalar(LAST_EVENT_BEFORE, {"since": since}) or 0


def transitions_between(
    session: Session, lo: int, hi: int
) -> Iterator[tuple[str | None, str, str | None, bool, int]]:
    """``(from, to, reason, by the reconciler, count)`` of the events in ``(lo, hi]``."""
    yield from session.execute(TRANSITIONS_BETWEEN, {"lo": lo, "hi": hi})


def outcomes_between(session: Session, lo: int, hi: int) -> Iterator[tuple[str, int]]:
    """``(proof, count)`` of the attempt outcomes the events in ``(lo, hi]`` recorded."""
    yield from session.execute(OUTCOMES_BETWEEN, {"lo": lo, "hi": hi})


def gaps_between(session: Session, lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """``(before, after)`` around each run of ids in ``(lo, hi]`` with no visible event."""
    yield from session.execute(GAPS_BETWEEN, {"lo": lo, "hi": hi})


def transitions_of(
    session: Session, ids: Collection[int]
) -> Iterator[tuple[int, str | None, str, str | None, bool]]:
    """``(id, from, to, reason, by the reconciler)`` of the events ``ids`` visible now."""
    yield from session.execute(TRANSITIONS_OF, {"ids": list(ids)})


def outcomes_of(session: Session, ids: Collection[int]) -> Iterator[tuple[int, Any]]:
    """``(id, proof)`` of the attempt outcomes the events ``ids`` recorded."""
    yield from session.execute(OUTCOMES_OF, {"ids": list(ids)})


def last_clock_step_before(session: Session, since: datetime) -> int:
    """The id of the last step of the database's clock recorded before ``since`` (0: none)."""
    return session.scalar(LAST_CLOCK_STEP_BEFORE, {"since": since}) or 0


def clock_steps_after(session: Session, lo: int) -> dict[str, int]:
    """Steps of the database's clock recorded after id ``lo``, by direction."""
    return {direction: n for direction, n in session.execute(CLOCK_STEPS_AFTER, {"lo": lo})}


def last_lag_before(session: Session, since: datetime) -> int:
    """The id of the last downstream clock lag row recorded before ``since`` (0: none)."""
    return session.scalar(LAST_LAG_BEFORE, {"since": since}) or 0


def lag_episodes_after(session: Session, lo: int) -> int:
    """Episodes of a downstream's clock lag beyond the margin begun after id ``lo``."""
    return session.scalar(LAG_EPISODES_AFTER, {"lo": lo}) or 0
