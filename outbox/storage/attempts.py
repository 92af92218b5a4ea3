"""Attempts: starting sends, what the attempts of an operation were, and the facts the
reconciler weighs (when each send may have been on the wire: quiescence).

An attempt row is written when its send starts, in the transition to ``submitted``, and
completed with what came back in the transition that records the outcome (a ``Finish``):
both through the one writer (``Storage.write_transitions``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import Table, bindparam, select
from sqlalchemy.orm import Session

from outbox.models import Attempt, Operation
from outbox.states import Event, State
from outbox.storage.claims import Claimed
from outbox.storage.connection import Bind
from outbox.storage.database import Storage
from outbox.storage.reviews import open_review_id
from outbox.storage.transitions import Transition

ops: Table = Operation.__table__  # type: ignore[assignment]
attempts: Table = Attempt.__table__  # type: ignore[assignment]

ATTEMPTS_OF = (
    select(Attempt)
    .where(Attempt.operation_id == bindparam("operation_id"))
    .order_by(Attempt.number)
)
SEND_TIMES = select(attempts.c.started_at, attempts.c.not_after, attempts.c.finished_at).where(
    attempts.c.operation_id == bindparam("operation_id")
)
LOOK_FACTS = select(ops.c.unknown_since, ops.c.lookups).where(ops.c.id == bindparam("operation_id"))


def start_attempts(
    storage: Storage,
    bind: Bind,
    claims: Sequence[Claimed],
    *,
    worker: str,
    event: Event = Event.CLAIM,
    looked: bool = False,
) -> list[Claimed]:
    """Move claimed operations to ``submitted`` and write their attempt rows: planned ones
    (``CLAIM``), or unknown ones sent again with the same key (``RESEND``; ``looked``: after a
    lookup, counted).

    Returns the claims started, as they are now. One whose fence no longer holds (its lease
    expired and a newer claim took it over) is refused, logged and left out: it must not be
    sent. Atomic as ``Storage.write_transitions`` is (on PostgreSQL one statement).
    """
    resend = {"resend": "same_key"} if event is Event.RESEND else {}
    starts = [
        Transition(
            c,
            event,
            State.SUBMITTED,
            evidence={"attempt": c.attempts + 1, **resend},
            release=False,
            start=True,
            looked=looked,
        )
        for c in claims
    ]
    written = storage.write_transitions(bind, starts, actor=worker) if starts else set()
    return [
        replace(
            c,
            state=State.SUBMITTED,
            attempts=c.attempts + 1,
            reached=c.reached + 1,  # in flight: not proven unsent
            first_sent_at=c.first_sent_at or c.now,
        )
        for c in claims
        if c.id in written
    ]


def attempt_history(session: Session, operation_id: int) -> list[dict[str, Any]]:
    """Every attempt of an operation, oldest first, JSON-safe: the one list of them, in the
    reconciler's evidence and in the operation staff read (``support.operation_view``)."""
    return [
        {
            "number": a.number,
            "started_at": a.started_at.isoformat(),
            "finished_at": a.finished_at.isoformat() if a.finished_at else None,
            "proof": a.proof,
            "status_code": a.status_code,
            "detail": a.detail,
        }
        for a in session.scalars(ATTEMPTS_OF, {"operation_id": operation_id})
    ]


@dataclass(frozen=True)
class OperationFacts:
    """What the reconciler (and staff's evidence rule) weigh beyond the claim snapshot."""

    unknown_since: datetime | None
    lookups: int
    last_sent_at: datetime | None
    in_review: bool
    #: per attempt: when it started, and the latest it may have been on the wire (its
    #: outcome's time, else its sender's lease end; None for attempts written before 0.2)
    sends: tuple[tuple[datetime, datetime | None], ...] = ()
    #: per attempt, in the order of ``sends``: its lease end (``not_after``; None before 0.2)
    lease_ends: tuple[datetime | None, ...] = ()


def operation_facts(session: Session, operation_id: int) -> OperationFacts:
    """The facts of one operation (``OperationFacts``, built by ``facts_of``)."""
    params = {"operation_id": operation_id}
    row = session.execute(LOOK_FACTS, params).one()
    rows = [(a.started_at, a.not_after, a.finished_at) for a in session.execute(SEND_TIMES, params)]
    in_review = open_review_id(session, operation_id) is not None
    return facts_of(row.unknown_since, row.lookups, in_review, rows)


def facts_of(
    unknown_since: datetime | None,
    lookups: int,
    in_review: bool,
    attempt_times: Sequence[tuple[datetime, datetime | None, datetime | None]],
) -> OperationFacts:
    """The facts from the operation's values and, per attempt, its start, its lease end
    (``not_after``) and its outcome's time (``finished_at``). Pure: the model checker
    (``tests/model``) builds the reconciler's facts with it."""
    sends = tuple(
        (start, on_wire_until(not_after, finished)) for start, not_after, finished in attempt_times
    )
    return OperationFacts(
        unknown_since,
        lookups,
        max((start for start, _ in sends), default=None),
        in_review,
        sends,
        tuple(not_after for _, not_after, _ in attempt_times),
    )


def on_wire_until(not_after: datetime | None, finished_at: datetime | None) -> datetime | None:
    """The earlier of the two bounds known: the attempt's lease end (no send outlives it) and
    the time its outcome was written (the request was over by then)."""
    bounds = [b for b in (not_after, finished_at) if b is not None]
    return min(bounds) if bounds else None
