"""Review items: open ones, resolving one, and staff settling an unknown operation.

Review items are opened and settled with the transitions that call for them
(``outbox.storage.transitions``); here is what staff do and what they read.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.orm import Session

from outbox.db import db_now
from outbox.models import ReviewItem
from outbox.states import Event, RejectReason, State
from outbox.storage.connection import Bind, connection_of
from outbox.storage.database import Storage
from outbox.storage.transitions import Note, Transition, Unclaimed

reviews: Table = ReviewItem.__table__  # type: ignore[assignment]

OPEN_REVIEW_ID = select(reviews.c.id).where(
    reviews.c.operation_id == bindparam("operation_id"), reviews.c.resolved_at.is_(None)
)
#: Closes the open items of operations (``ids``) that left ``unknown``: always after the
#: operation's own row was written in the same transaction (the operation row, then its
#: review item, is the one lock order: the reconciler's and staff's alike).
CLOSE_REVIEWS = (
    update(reviews)
    .where(
        reviews.c.operation_id.in_(bindparam("r_ids", expanding=True)),
        reviews.c.resolved_at.is_(None),
    )
    .values(
        resolved_at=db_now(),
        resolved_by=bindparam("r_by"),
        resolution=bindparam("r_resolution"),
        version=reviews.c.version + 1,
    )
)
RESOLVE_REVIEW = (
    update(reviews)
    .where(
        reviews.c.id == bindparam("r_item_id"),
        reviews.c.version == bindparam("r_version"),
        reviews.c.resolved_at.is_(None),
    )
    .values(
        resolved_at=db_now(),
        resolved_by=bindparam("r_by"),
        resolution=bindparam("r_resolution"),
        note=bindparam("r_note"),
        version=reviews.c.version + 1,
    )
)


IN_REVIEW_AMONG = select(reviews.c.operation_id).where(
    reviews.c.operation_id.in_(bindparam("ids", expanding=True)), reviews.c.resolved_at.is_(None)
)
REVIEW_REASON = select(reviews.c.reason).where(reviews.c.operation_id == bindparam("operation_id"))


def review_item(session: Session, item_id: int, *, fresh: bool = False) -> ReviewItem | None:
    """Review item ``item_id``; ``fresh``: read again even if the session holds it."""
    return session.get(ReviewItem, item_id, populate_existing=fresh)


def in_review(session: Session, operation_ids: Collection[int]) -> set[int]:
    """Those of these operations with an open review item."""
    return set(session.scalars(IN_REVIEW_AMONG, {"ids": sorted(operation_ids)}))


def review_reason(session: Session, operation_id: int) -> str | None:
    """Why the operation was put in review (None: it never was)."""
    reason: str | None = session.scalars(REVIEW_REASON, {"operation_id": operation_id}).first()
    return reason


def open_review_id(bind: Bind, operation_id: int) -> int | None:
    """The operation's open review item, if it has one."""
    value: int | None = connection_of(bind).scalar(OPEN_REVIEW_ID, {"operation_id": operation_id})
    return value


def resolve_review(
    session: Session,
    item_id: int,
    *,
    version: int,
    by: str,
    resolution: dict[str, Any],
    note: str | None,
) -> bool:
    """Close review item ``item_id`` if it is still open at ``version`` (optimistic lock)."""
    result = session.connection().execute(
        RESOLVE_REVIEW,
        {
            "r_item_id": item_id,
            "r_version": version,
            "r_by": by,
            "r_resolution": resolution,
            "r_note": note,
        },
    )
    return result.rowcount == 1


def settle_unknown(
    storage: Storage,
    session: Session,
    operation_id: int,
    event: Event,
    to: State,
    *,
    actor: str,
    reason: RejectReason | None = None,
    receipt: dict[str, Any] | None = None,
    evidence: dict[str, Any] | None = None,
    close_review: bool = True,
) -> bool:
    """Settle an ``unknown`` operation outside any claim (staff, or a staff-asked lookup).

    Bumps the fencing version, so a reconciler holding a lease can no longer write. Returns
    False, writing nothing, if the operation is no longer unknown. Its open review item is
    closed with it, unless ``close_review`` is False (the caller resolves the item itself,
    after this: the operation row first, then the item, is the one lock order).
    """
    settled = Transition(
        Unclaimed(operation_id, State.UNKNOWN),
        event,
        to,
        reason=reason,
        evidence=evidence,
        receipt=receipt,
        note=reason.value if reason else event.value,
        closes_review=close_review,
    )
    return bool(storage.write_transitions(session, [settled], actor=actor))


def note_staff_action(
    storage: Storage,
    session: Session,
    operation_id: int,
    *,
    actor: str,
    note: str,
    evidence: dict[str, Any],
) -> None:
    """An event row that changes no state: a staff requery, or a refused staff action."""
    storage.write_transitions(
        session, [Note(operation_id, note=note, evidence=evidence)], actor=actor
    )
