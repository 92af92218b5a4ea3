"""Reads of operation rows, the database's clock, and the intake INSERT's shape."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import Float, Table, bindparam, func, select
from sqlalchemy.orm import Session

from outbox.db import db_now
from outbox.models import Operation, UTCDateTime
from outbox.states import State

ops: Table = Operation.__table__  # type: ignore[assignment]

#: The columns intake writes from its parameters (``Storage.create_operation``).
INTAKE_PARAMS = (
    "tenant", "op_id", "kind", "params", "fingerprint", "fingerprint_key_version",
    "idempotency_key", "max_attempts", "run_id", "correlation_id", "compensates_id",
)  # fmt: skip


def intake_insert(insert: Callable[[Any], Any]) -> Any:
    """The intake INSERT built with a database's own ``insert`` construct (for ON CONFLICT):
    returns the new Operation, or nothing on a conflict. Parameters: ``INTAKE_PARAMS``,
    ``deadline`` (None: ``default_deadline_seconds`` from now, in database time)."""
    deadline = bindparam("deadline", type_=UTCDateTime())
    default = db_now(bindparam("default_deadline_seconds", type_=Float()))
    returning = (
        insert(Operation)
        .values(
            **{name: bindparam(name) for name in INTAKE_PARAMS},
            state=State.PLANNED.value,
            attempts=0,
            deadline=func.coalesce(deadline, default),
            next_attempt_at=db_now(),
            created_at=db_now(),
            updated_at=db_now(),
        )
        .on_conflict_do_nothing(index_elements=["tenant", "op_id"])
        .returning(Operation)
    )
    # As a SELECT from the statement: one row into the session, no ORM bulk-insert machinery.
    return select(Operation).from_statement(returning)


DB_TIME = select(db_now())
OLDEST_UNKNOWN_SINCE = select(func.min(ops.c.unknown_since)).where(
    ops.c.state == State.UNKNOWN.value
)


def db_time(session: Session) -> datetime:
    """The database's clock."""
    value: datetime | None = session.scalar(DB_TIME)
    assert value is not None
    return value


def oldest_unknown_since(session: Session) -> datetime | None:
    """When the longest-unknown operation became unknown (None: none is)."""
    value: datetime | None = session.scalar(OLDEST_UNKNOWN_SINCE)
    return value
