"""Claims: the conditional UPDATEs that lease operations, lease renewal, and due ids.

A claim is a conditional UPDATE (state and an expired lease in the WHERE clause, repeated on
the row itself) that sets a lease in database time and bumps the fencing version; every later
write names that version and changes nothing if a newer claim has taken over
(``outbox.storage.transitions``). ``SKIP LOCKED`` only reduces contention; it is not what
makes a claim exclusive (SQLite, which writes one transaction at a time, has no such clause
and SQLAlchemy leaves it out there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Float,
    Table,
    and_,
    bindparam,
    func,
    literal_column,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.orm import Session

from outbox.db import db_now, db_statement_now, in_once
from outbox.models import Attempt, Operation
from outbox.states import State
from outbox.storage.connection import Bind, connection_of

ops: Table = Operation.__table__  # type: ignore[assignment]
attempts: Table = Attempt.__table__  # type: ignore[assignment]

#: The attempts of the claimed row that may have reached the downstream: every one whose
#: outcome is not "not sent" (in flight or lost with its worker included). Read from the
#: attempt rows, the one record of what each send proved (an index range per operation).
#: The row's id is named in full: SQLite's RETURNING drops table names, and a bare ``id``
#: inside the sub-select would be the attempt's.
REACHED = (
    select(func.count())
    .where(
        attempts.c.operation_id == literal_column("operations.id"),
        or_(attempts.c.proof.is_(None), attempts.c.proof != "not_sent"),
    )
    .scalar_subquery()
    .label("reached")
)


@dataclass(frozen=True)
class Claimed:
    """A snapshot of an operation taken with its lease; ``now`` is the database's clock."""

    id: int
    tenant: str
    op_id: str
    kind: str
    params: dict[str, Any]
    fingerprint: str
    fingerprint_key_version: str
    idempotency_key: str
    state: State
    attempts: int
    max_attempts: int
    deadline: datetime
    first_sent_at: datetime | None
    run_id: int | None
    lease_version: int
    lease_until: datetime
    now: datetime
    #: attempts that may have reached the downstream (every one not proven unsent): what
    #: ``max_attempts`` counts; ``attempts`` counts every try
    reached: int = 0


_COLUMNS = [
    ops.c.id,
    ops.c.tenant,
    ops.c.op_id,
    ops.c.kind,
    ops.c.params,
    ops.c.fingerprint,
    ops.c.fingerprint_key_version,
    ops.c.idempotency_key,
    ops.c.state,
    ops.c.attempts,
    ops.c.max_attempts,
    ops.c.deadline,
    ops.c.first_sent_at,
    ops.c.run_id,
    ops.c.lease_version,
    ops.c.lease_until,
    REACHED,
]

Clock = Callable[[], Any]


def _lease_free(now: Clock) -> Any:
    return or_(ops.c.lease_until.is_(None), ops.c.lease_until < now())


def _due(now: Clock) -> Any:
    return and_(ops.c.state == State.PLANNED.value, ops.c.next_attempt_at <= now())


def _abandoned(now: Clock) -> Any:
    return and_(ops.c.state == State.SUBMITTED.value, ops.c.lease_until < now())


def _claim_statement(where: Callable[[Clock], Any], order: Any) -> Any:
    """The claim UPDATE of the operations matching ``where``, oldest by ``order`` first.

    Parameters: ``worker``, ``lease_seconds``, ``limit`` (and whatever ``where`` names).
    The candidates are found with ``where`` at the statement's time, which their indexes can
    use (``db_statement_now``); the UPDATE repeats it on each row at the database's clock
    (``db_now``: a little later, so it holds for every candidate), which no index can use, so
    the UPDATE finds its rows by primary key instead of scanning every due row again.
    """
    candidates = (
        select(ops.c.id)
        .where(where(db_statement_now))
        .order_by(order)
        .limit(bindparam("limit"))
        .with_for_update(skip_locked=True)
    )
    return (
        update(ops)
        # The WHERE clause is repeated on the row itself: this, not the sub-select, is what
        # makes the claim exclusive. ``in_once``: the sub-select (its LIMIT) runs once.
        .where(in_once(ops.c.id, candidates), where(db_now))
        .values(
            lease_owner=bindparam("worker"),
            lease_until=db_now(bindparam("lease_seconds", type_=Float())),
            lease_version=ops.c.lease_version + 1,
        )
        .returning(*_COLUMNS, db_now().label("now"))
    )


#: Hinted operations (``ids``): planned and due, or submitted with an expired lease.
CLAIM_HINTED = _claim_statement(
    lambda now: and_(
        ops.c.id.in_(bindparam("ids", expanding=True)),
        or_(_due(now), ops.c.state == State.SUBMITTED.value),
        _lease_free(now),
    ),
    ops.c.id,
)
#: Any planned and due operations.
CLAIM_DUE = _claim_statement(lambda now: and_(_due(now), _lease_free(now)), ops.c.next_attempt_at)
#: Unknown operations due for a look, and submitted ones whose lease expired.
CLAIM_UNRESOLVED = _claim_statement(
    lambda now: or_(
        and_(
            ops.c.state == State.UNKNOWN.value,
            ops.c.next_attempt_at <= now(),
            _lease_free(now),
        ),
        _abandoned(now),
    ),
    ops.c.next_attempt_at,
)
#: Extends the leases still held (``held``: (id, lease version) pairs) by ``owner``; returns
#: each renewed lease's new end.
RENEW_LEASES = (
    update(ops)
    .where(
        tuple_(ops.c.id, ops.c.lease_version).in_(bindparam("held", expanding=True)),
        ops.c.lease_owner == bindparam("owner"),
        ops.c.lease_until >= db_now(),
    )
    .values(lease_until=db_now(bindparam("lease_seconds", type_=Float())))
    .returning(ops.c.id, ops.c.lease_until)
)
DUE_PLANNED = (
    select(ops.c.id)
    .where(_due(db_statement_now), _lease_free(db_statement_now))
    .limit(bindparam("limit"))
)
DUE_ABANDONED = select(ops.c.id).where(_abandoned(db_statement_now)).limit(bindparam("limit"))


def _claim(
    bind: Bind, statement: Any, *, worker: str, lease_seconds: float, limit: int, **params: Any
) -> list[Claimed]:
    rows = connection_of(bind).execute(
        statement,
        {"worker": worker, "lease_seconds": float(lease_seconds), "limit": limit, **params},
    )
    return [Claimed(**{**row, "state": State(row["state"])}) for row in rows.mappings()]


def claim_for_send(
    bind: Bind,
    *,
    worker: str,
    lease_seconds: float,
    ids: Sequence[int] = (),
    extra: int = 0,
) -> list[Claimed]:
    """Lease the hinted operations, plus up to ``extra`` other due ones.

    Hinted operations are taken when planned and due, or submitted with an expired lease
    (a worker died mid-send: the caller must query, never re-send). A duplicate hint, or a
    hint for an operation another worker holds, claims nothing, and then no other either: its
    operations were taken (most often as another claim's extras), so that claim's worker is
    already on the backlog, and this one's hint costs a single statement.
    """
    claimed: list[Claimed] = []
    if ids:
        claimed += _claim(
            bind,
            CLAIM_HINTED,
            worker=worker,
            lease_seconds=lease_seconds,
            limit=len(ids),
            ids=list(ids),
        )
    if extra > 0 and (claimed or not ids):
        claimed += _claim(bind, CLAIM_DUE, worker=worker, lease_seconds=lease_seconds, limit=extra)
    return claimed


def claim_unresolved(bind: Bind, *, worker: str, lease_seconds: float, limit: int) -> list[Claimed]:
    """Lease ``unknown`` operations due for a look, and ``submitted`` ones whose lease expired.

    For unknown operations ``next_attempt_at`` is the time of the next look (the reconciler
    backs off); it never means a send.
    """
    return _claim(bind, CLAIM_UNRESOLVED, worker=worker, lease_seconds=lease_seconds, limit=limit)


def renew_leases(
    bind: Bind, held: Sequence[tuple[int, int]], *, owner: str, lease_seconds: float
) -> dict[int, datetime]:
    """Extend the leases ``owner`` still holds: ``held`` is (operation id, lease version).

    A lease is renewed only while it is the same claim (owner and version) and has not yet
    expired: an expired lease may already be another's to take, so it is never revived.
    Returns the ids renewed, each with its lease's new end (database time). Renewing never
    bumps the version, and never moves a send's bound: a send is bounded by the lease it was
    claimed with (``attempts.not_after``).
    """
    if not held:
        return {}
    params = {
        "held": [tuple(h) for h in held],
        "owner": owner,
        "lease_seconds": float(lease_seconds),
    }
    rows = connection_of(bind).execute(RENEW_LEASES, params)
    return {row.id: row.lease_until for row in rows}


def due_ids(session: Session, *, limit: int) -> list[int]:
    """Operations a worker should pick up now: planned and due, or submitted and abandoned."""
    ids = list(session.scalars(DUE_PLANNED, {"limit": limit}))
    ids += session.scalars(DUE_ABANDONED, {"limit": limit})
    return ids[:limit]
