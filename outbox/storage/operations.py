"""Reads of operation rows, the database's clock, and the intake INSERT's shape."""

from __future__ import annotations

from collections.abc import Callable, Collection
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Float, Table, bindparam, func, literal, select
from sqlalchemy.orm import Session

from outbox.db import db_now
from outbox.models import Operation, UTCDateTime
from outbox.states import State
from outbox.storage.tombstones import NOT_TOMBSTONED

ops: Table = Operation.__table__  # type: ignore[assignment]

#: The columns intake writes from its parameters (``Storage.create_operation``).
INTAKE_PARAMS = (
    "tenant", "op_id", "kind", "params", "fingerprint", "fingerprint_key_version",
    "idempotency_key", "max_attempts", "run_id", "correlation_id", "compensates_id",
)  # fmt: skip


#: What the intake statement returns of the new row (``outbox.intake.Enqueued``'s values).
INTAKE_RETURNS = (
    "id", "tenant", "op_id", "kind", "state", "idempotency_key", "deadline", "run_id",
    "compensates_id", "correlation_id",
)  # fmt: skip


def intake_insert(insert: Callable[[Any], Any], lock: ColumnElement[Any] | None = None) -> Any:
    """The intake INSERT built with a database's own ``insert`` construct (for ON CONFLICT),
    a Core statement: returns the new row's ``INTAKE_RETURNS`` plus its ``created_at``, or
    nothing on a conflict. Parameters: ``INTAKE_PARAMS``, ``deadline`` (None:
    ``default_deadline_seconds`` from now, in database time).

    It inserts nothing where ``(tenant, op_id)`` has a tombstone (a pruned operation:
    ``outbox.storage.tombstones``), as if the operation were still there.

    ``lock``: an expression the row is selected through, evaluated before the row is written,
    in the same statement (PostgreSQL: the order's lock, ``PostgresStorage``), so taking it
    costs no round trip.

    The ``created`` event row is written by the same statement: on PostgreSQL a
    data-modifying CTE around this one (``created_event``), on SQLite the
    ``operations_created_event`` trigger (migration 0009)."""
    deadline = bindparam("deadline", type_=UTCDateTime())
    default = db_now(bindparam("default_deadline_seconds", type_=Float()))
    values: dict[str, Any] = {
        **{name: bindparam(name, type_=ops.c[name].type) for name in INTAKE_PARAMS},
        "state": literal(State.PLANNED.value, type_=ops.c.state.type),
        "attempts": literal(0, type_=ops.c.attempts.type),
        "deadline": func.coalesce(deadline, default),
        "next_attempt_at": db_now(),
        "created_at": db_now(),
        "updated_at": db_now(),
    }
    row = select(*(value.label(name) for name, value in values.items())).where(NOT_TOMBSTONED)
    if lock is not None:
        row = row.select_from(select(lock.label("locked")).subquery("order_lock"))
    statement = insert(ops).from_select(list(values), row)
    returned = [ops.c[name] for name in (*INTAKE_RETURNS, "created_at")]
    return statement.on_conflict_do_nothing(index_elements=["tenant", "op_id"]).returning(*returned)


FIND_OPERATION = select(Operation).where(
    Operation.tenant == bindparam("tenant"), Operation.op_id == bindparam("op_id")
)
ALL_OPERATIONS = select(Operation).order_by(Operation.id)
COMPENSATIONS_OF = (
    select(Operation)
    .where(
        Operation.tenant == bindparam("tenant"),
        Operation.compensates_id == bindparam("operation_id"),
    )
    .order_by(Operation.id)
)
OP_IDS = select(Operation.id, Operation.op_id).where(
    Operation.id.in_(bindparam("ids", expanding=True))
)
DB_TIME = select(db_now())
#: A tenant's operation by the idempotency key it was sent with (a provider's notification
#: names it: WeChat Pay's ``out_refund_no``); limited to the tenant, never across tenants.
BY_TENANT_KEY = select(Operation).where(
    Operation.tenant == bindparam("tenant"), Operation.idempotency_key == bindparam("key")
)
OLDEST_UNKNOWN_SINCE = select(func.min(ops.c.unknown_since)).where(
    ops.c.state == State.UNKNOWN.value
)


def find_operation(session: Session, tenant: str, op_id: str) -> Operation | None:
    """Operation ``op_id`` of ``tenant``, loaded into ``session`` (None: no such one)."""
    found: Operation | None = session.scalars(
        FIND_OPERATION, {"tenant": tenant, "op_id": op_id}
    ).one_or_none()
    return found


def operation_by_key(session: Session, tenant: str, key: str) -> Operation | None:
    """``tenant``'s operation sent with idempotency key ``key`` (None: no such one)."""
    found: Operation | None = session.scalars(BY_TENANT_KEY, {"tenant": tenant, "key": key}).first()
    return found


def operation(session: Session, operation_id: int) -> Operation | None:
    """The operation with this primary key, loaded into ``session``."""
    return session.get(Operation, operation_id)


def compensations_of(session: Session, tenant: str, operation_id: int) -> list[Operation]:
    """The operations enqueued to compensate this one, oldest first."""
    return list(session.scalars(COMPENSATIONS_OF, {"tenant": tenant, "operation_id": operation_id}))


def op_ids_of(session: Session, ids: Collection[int]) -> dict[int, str]:
    """The op_id of each of these operations (by primary key)."""
    return {i: op_id for i, op_id in session.execute(OP_IDS, {"ids": sorted(ids)})}


def all_operations(session: Session) -> list[Operation]:
    """Every operation, oldest first (small databases only: the demo's)."""
    return list(session.scalars(ALL_OPERATIONS))


def db_time(session: Session) -> datetime:
    """The database's clock."""
    value: datetime | None = session.scalar(DB_TIME)
    assert value is not None
    return value


def oldest_unknown_since(session: Session) -> datetime | None:
    """When the longest-unknown operation became unknown (None: none is)."""
    value: datetime | None = session.scalar(OLDEST_UNKNOWN_SINCE)
    return value


#: Operations, oldest first, that the operator's list narrows (``listed_operations``).
LISTED = select(Operation).order_by(Operation.created_at, Operation.id).limit(bindparam("limit"))


def listed_operations(
    session: Session,
    *,
    state: str | None = None,
    reason: str | None = None,
    tenant: str | None = None,
    created_before: datetime | None = None,
    limit: int = 50,
) -> list[Operation]:
    """The first ``limit`` operations, oldest first, in ``state``, rejected for ``reason``,
    of ``tenant``, created before ``created_before`` (each None: any)."""
    stmt = LISTED
    params: dict[str, Any] = {"limit": limit}
    narrowing = {"state": (Operation.state, state), "reason": (Operation.reason, reason),
                 "tenant": (Operation.tenant, tenant)}  # fmt: skip
    for name, (column, value) in narrowing.items():
        if value is not None:
            stmt = stmt.where(column == bindparam(name))
            params[name] = value
    if created_before is not None:
        stmt = stmt.where(Operation.created_at < bindparam("created_before"))
        params["created_before"] = created_before
    return list(session.scalars(stmt, params))
