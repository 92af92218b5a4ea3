"""Reads of the audit trail: an operation's event rows (written by ``Storage.write_transitions``
only), oldest first."""

from __future__ import annotations

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from outbox.models import OperationEvent

EVENTS_OF = (
    select(OperationEvent)
    .where(OperationEvent.operation_id == bindparam("operation_id"))
    .order_by(OperationEvent.id)
)
STATES_OF = (
    select(OperationEvent.from_state, OperationEvent.to_state)
    .where(OperationEvent.operation_id == bindparam("operation_id"))
    .order_by(OperationEvent.id)
)


def events_of(session: Session, operation_id: int) -> list[OperationEvent]:
    """Every event row of an operation, oldest first."""
    return list(session.scalars(EVENTS_OF, {"operation_id": operation_id}))


def states_passed(session: Session, operation_id: int) -> list[str]:
    """The states an operation went through, from its creation on (looks left out)."""
    rows = session.execute(STATES_OF, {"operation_id": operation_id})
    return [to for frm, to in rows if frm != to]
