"""SQLite (the embedded default): transitions a few statements each, in the caller's
transaction; a worker's step is one transaction.

SQLite has no data-modifying CTEs, so a transition is written by module-constant Core
statements run one after another: the fenced UPDATE (RETURNING what the others need), then
its event row, review item and attempt row. SQLite writes one transaction at a time, so the
step's transaction makes them atomic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import (
    JSON,
    Boolean,
    Connection,
    Integer,
    Table,
    bindparam,
    case,
    false,
    func,
    insert,
    or_,
    update,
)
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from outbox.db import db_now
from outbox.models import Attempt, Operation, OperationEvent, ReviewItem, UTCDateTime
from outbox.states import State
from outbox.storage.connection import Bind, run_twice
from outbox.storage.database import Storage
from outbox.storage.operations import intake_insert
from outbox.storage.replication import Replication
from outbox.storage.reviews import CLOSE_REVIEWS
from outbox.storage.transitions import Finish, Transition

T = TypeVar("T")

ops: Table = Operation.__table__  # type: ignore[assignment]
events: Table = OperationEvent.__table__  # type: ignore[assignment]
attempts: Table = Attempt.__table__  # type: ignore[assignment]
reviews: Table = ReviewItem.__table__  # type: ignore[assignment]

_NOW = db_now()
_VERSION = bindparam("t_lease_version", type_=Integer())


def _flag(name: str) -> Any:
    return bindparam(name, type_=Boolean())


def _keep_unless(flag: str, value: Any, column: Any) -> Any:
    return case((_flag(flag), value), else_=column)


#: The fenced UPDATE of one transition (see ``outbox.storage.transitions``).
FENCED_UPDATE = (
    update(ops)
    .where(
        ops.c.id == bindparam("t_id"),
        ops.c.state == bindparam("t_from_state"),
        or_(_VERSION.is_(None), ops.c.lease_version == _VERSION),
    )
    .values(
        state=bindparam("t_to_state"),
        reason=bindparam("t_reason"),
        next_attempt_at=_keep_unless(
            "t_due_now",
            _NOW,
            func.coalesce(
                bindparam("t_next_attempt_at", type_=UTCDateTime()), ops.c.next_attempt_at
            ),
        ),
        receipt=_keep_unless(
            "t_stores_receipt", bindparam("t_receipt", type_=JSON()), ops.c.receipt
        ),
        downstream_ref=_keep_unless(
            "t_stores_receipt", bindparam("t_downstream_ref"), ops.c.downstream_ref
        ),
        lookups=_keep_unless("t_looked", ops.c.lookups + 1, ops.c.lookups),
        unknown_since=_keep_unless("t_becomes_unknown", _NOW, ops.c.unknown_since),
        attempts=_keep_unless("t_start", ops.c.attempts + 1, ops.c.attempts),
        first_sent_at=_keep_unless(
            "t_start", func.coalesce(ops.c.first_sent_at, _NOW), ops.c.first_sent_at
        ),
        lease_owner=_keep_unless("t_release", None, ops.c.lease_owner),
        lease_until=_keep_unless("t_release", None, ops.c.lease_until),
        lease_version=case(
            (_VERSION.is_(None), ops.c.lease_version + 1), else_=ops.c.lease_version
        ),
        updated_at=_NOW,
    )
    .returning(ops.c.tenant, ops.c.lease_version, ops.c.lease_until)
)
INSERT_EVENT = insert(events).values(at=_NOW)
#: At most one open item per operation (a partial unique index).
OPEN_REVIEW = (
    sqlite_insert(reviews)
    .values(version=1, created_at=_NOW)
    .on_conflict_do_nothing(
        index_elements=["operation_id"], index_where=reviews.c.resolved_at.is_(None)
    )
)
START_ATTEMPT = insert(attempts).values(started_at=_NOW)
FINISH_ATTEMPT = (
    update(attempts)
    .where(
        attempts.c.operation_id == bindparam("f_id"),
        attempts.c.number == bindparam("f_number"),
        attempts.c.lease_version == bindparam("f_version"),
    )
    .values(
        finished_at=_NOW,
        proof=bindparam("f_proof"),
        status_code=bindparam("f_status"),
        detail=bindparam("f_detail"),
    )
)
_INSERT_OPERATION = intake_insert(sqlite_insert)
#: A write that changes nothing: it takes SQLite's write lock (``SqliteStorage.serialize``).
_TAKE_WRITE_LOCK = update(ops).where(false()).values(id=ops.c.id)


def _update_params(t: Transition) -> dict[str, Any]:
    return {
        "t_id": t.id,
        "t_from_state": t.from_state.value,
        "t_lease_version": t.lease_version,
        "t_to_state": t.to.value,
        "t_reason": t.reason.value if t.reason else None,
        "t_due_now": t.due_now,
        "t_next_attempt_at": t.next_attempt_at,
        "t_stores_receipt": t.receipt is not None,
        "t_receipt": t.receipt,
        "t_downstream_ref": (t.receipt or {}).get("reference"),
        "t_looked": t.looked,
        "t_becomes_unknown": t.to is State.UNKNOWN and t.from_state is not State.UNKNOWN,
        "t_start": t.start,
        "t_release": t.release,
    }


class SqliteStorage(Storage):
    """SQLite: each transition a few statements; a worker's step is one transaction."""

    def serialize(self, session: Session, key: str) -> None:
        # SQLite has one writer at a time: taking the write lock now (a write that changes
        # nothing) makes every other writer wait here, before its read, instead of failing on
        # a stale read at its insert. A transaction begun explicitly on an engine from
        # ``make_engine`` holds it already (BEGIN IMMEDIATE); this is for one that was not.
        del key
        session.execute(_TAKE_WRITE_LOCK)

    def lock_order(self, session: Session, key: str, *, shared: bool = False) -> None:
        # Exclusive: the write lock, as ``serialize``. Shared (intake): nothing to take here;
        # the INSERT that follows takes the write lock and holds it until the app commits.
        if not shared:
            self.serialize(session, key)

    def _write(
        self,
        conn: Connection,
        transitions: Sequence[Transition],
        *,
        actor: str,
        finishes: Mapping[int, Finish],
    ) -> set[int]:
        written: set[int] = set()
        for t in transitions:
            row = conn.execute(FENCED_UPDATE, _update_params(t)).first()
            if row is None:
                continue
            written.add(t.id)
            conn.execute(
                INSERT_EVENT,
                {
                    "operation_id": t.id,
                    "from_state": t.from_state.value,
                    "to_state": t.to.value,
                    "actor": actor,
                    "lease_version": row.lease_version,
                    "reason": t.event_reason,
                    "evidence": t.evidence or None,
                },
            )
            if t.review is not None:
                conn.execute(
                    OPEN_REVIEW,
                    {
                        "operation_id": t.id,
                        "tenant": row.tenant,
                        "reason": t.review,
                        "evidence": t.evidence or {},
                    },
                )
            if t.settles_review:
                conn.execute(
                    CLOSE_REVIEWS,
                    {"r_ids": [t.id], "r_by": actor, "r_resolution": t.resolution(actor)},
                )
            if t.start:
                conn.execute(
                    START_ATTEMPT,
                    {
                        "operation_id": t.id,
                        "number": t.attempt_number,
                        "lease_version": t.lease_version,
                        "worker": actor,
                        "not_after": row.lease_until,
                    },
                )
            if (f := finishes.get(t.id)) is not None:
                conn.execute(
                    FINISH_ATTEMPT,
                    {
                        "f_id": t.id,
                        "f_number": f.claimed.attempts,
                        "f_version": f.claimed.lease_version,
                        "f_proof": f.proof,
                        "f_status": f.status_code,
                        "f_detail": f.detail,
                    },
                )
        return written

    def _insert_operation(
        self, session: Session, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        row = session.execute(_INSERT_OPERATION, params).one_or_none()
        return None if row is None else dict(row._mapping)

    def replication(self, bind: Bind) -> Replication | None:
        return None

    def step(self, work: Callable[[Connection], T], *, one_commit: bool = False) -> T:
        """In one transaction, always."""

        def once() -> T:
            with self.engine.begin() as conn:
                return work(conn)

        return run_twice(once)
