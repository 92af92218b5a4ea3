"""What the console's overview reads: operations by state, the reconciler's latest passes,
and the operations settled in a recent window (with when each was created).

The counts by state read the whole operations table once (a console page, not a scrape: the
Prometheus gauges that must stay cheap are ``outbox.storage.metrics``); the window reads
only the events since its start, bounded by ``MAX_SETTLED``.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import Any

from sqlalchemy import BindParameter, ColumnElement, Select, Table, bindparam, func, select
from sqlalchemy.orm import Session

from outbox.models import Operation, OperationEvent, ReviewItem
from outbox.states import State

ops: Table = Operation.__table__  # type: ignore[assignment]
events: Table = OperationEvent.__table__  # type: ignore[assignment]
reviews: Table = ReviewItem.__table__  # type: ignore[assignment]

TERMINAL = [State.SUCCEEDED.value, State.REJECTED.value, State.CANCELLED.value]
MAX_SETTLED = 20_000
_TENANTS: BindParameter[Any] = bindparam("tenants", expanding=True)

BY_STATE = select(ops.c.state, func.count()).group_by(ops.c.state)
OLDEST_UNKNOWN = select(func.min(ops.c.unknown_since)).where(ops.c.state == State.UNKNOWN.value)
OPEN_REVIEWS = select(func.count()).select_from(reviews).where(reviews.c.resolved_at.is_(None))
#: Each reconciler process's latest event since ``since``, and how many it wrote.
RECONCILE_PASSES = (
    select(events.c.actor, func.max(events.c.at), func.count())
    .where(events.c.actor.like("reconciler:%"), events.c.at >= bindparam("since"))
    .group_by(events.c.actor)
    .order_by(func.max(events.c.at).desc())
    .limit(10)
)
#: Operations that reached a terminal state since ``since``: when, and when they were made.
SETTLED_SINCE = (
    select(events.c.at, ops.c.created_at)
    .join(ops, ops.c.id == events.c.operation_id)
    .where(
        events.c.at >= bindparam("since"),
        events.c.to_state.in_(TERMINAL),
        events.c.from_state.is_distinct_from(events.c.to_state),
    )
    .order_by(events.c.id)
    .limit(MAX_SETTLED)
)


def _limited(
    stmt: Select[Any],
    column: ColumnElement[Any],
    tenants: Collection[str] | None,
    params: dict[str, object],
) -> Select[Any]:
    """``stmt`` narrowed to ``tenants`` (None: all), the value put in ``params``."""
    if tenants is None:
        return stmt
    params["tenants"] = sorted(tenants)
    return stmt.where(column.in_(_TENANTS))


def counts_by_state(session: Session, tenants: Collection[str] | None) -> dict[str, int]:
    """How many operations (of ``tenants``; None: all) are in each state."""
    params: dict[str, object] = {}
    stmt = _limited(BY_STATE, ops.c.tenant, tenants, params)
    return {state: n for state, n in session.execute(stmt, params)}


def oldest_unknown(session: Session, tenants: Collection[str] | None) -> datetime | None:
    """Since when the longest-unknown operation is unknown (None: none is)."""
    params: dict[str, object] = {}
    value: datetime | None = session.scalar(
        _limited(OLDEST_UNKNOWN, ops.c.tenant, tenants, params), params
    )
    return value


def review_depth(session: Session, tenants: Collection[str] | None) -> int:
    """Open review items."""
    params: dict[str, object] = {}
    return session.scalar(_limited(OPEN_REVIEWS, reviews.c.tenant, tenants, params), params) or 0


def reconcile_passes(session: Session, since: datetime) -> list[tuple[str, datetime, int]]:
    """``(reconciler, its latest event, events written)`` since ``since``, latest first."""
    return [(a, at, n) for a, at, n in session.execute(RECONCILE_PASSES, {"since": since})]


def settled_since(
    session: Session, since: datetime, tenants: Collection[str] | None
) -> list[tuple[datetime, datetime]]:
    """``(settled at, created at)`` of each operation that became terminal since ``since``."""
    params: dict[str, object] = {"since": since}
    stmt = _limited(SETTLED_SINCE, ops.c.tenant, tenants, params)
    return [(at, created) for at, created in session.execute(stmt, params)]
