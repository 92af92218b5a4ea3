"""Every SQL statement that claims or transitions an operation.

Claims are conditional UPDATEs (state and an expired lease in the WHERE clause) that set a
lease in database time and bump the fencing version; every later write names that version
and changes nothing if a newer claim has taken over. ``SKIP LOCKED`` only reduces contention.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import Table, and_, func, insert, or_, select, update
from sqlalchemy.orm import Session

from outbox.db import db_now
from outbox.errors import StaleLease
from outbox.models import Attempt, Operation, OperationEvent, ReviewItem, Run
from outbox.states import Event, RejectReason, State, transition

log = logging.getLogger(__name__)
ops: Table = Operation.__table__  # type: ignore[assignment]


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
]


def _lease_free() -> Any:
    return or_(ops.c.lease_until.is_(None), ops.c.lease_until < db_now())


def _due() -> Any:
    return and_(ops.c.state == State.PLANNED.value, ops.c.next_attempt_at <= db_now())


def _claim(
    session: Session, where: Any, *, worker: str, lease_seconds: float, limit: int, order: Any
) -> list[Claimed]:
    candidates = select(ops.c.id).where(where).order_by(order).limit(limit)
    if session.get_bind().dialect.name == "postgresql":
        candidates = candidates.with_for_update(skip_locked=True)
    stmt = (
        update(ops)
        # The WHERE clause is repeated on the row itself: this, not the sub-select, is what
        # makes the claim exclusive.
        .where(ops.c.id.in_(candidates.scalar_subquery()), where)
        .values(
            lease_owner=worker,
            lease_until=db_now(lease_seconds),
            lease_version=ops.c.lease_version + 1,
        )
        .returning(*_COLUMNS, db_now().label("now"))
    )
    rows = session.execute(stmt).mappings().all()
    return [Claimed(**{**row, "state": State(row["state"])}) for row in rows]


def claim_for_send(
    session: Session,
    *,
    worker: str,
    lease_seconds: float,
    ids: Sequence[int] = (),
    extra: int = 0,
) -> list[Claimed]:
    """Lease the hinted operations, plus up to ``extra`` other due ones.

    Hinted operations are taken when planned and due, or submitted with an expired lease
    (a worker died mid-send: the caller must query, never re-send). A duplicate hint, or a
    hint for an operation another worker holds, claims nothing.
    """
    claimed: list[Claimed] = []
    if ids:
        hinted = and_(
            ops.c.id.in_(list(ids)),
            or_(_due(), ops.c.state == State.SUBMITTED.value),
            _lease_free(),
        )
        claimed += _claim(
            session,
            hinted,
            worker=worker,
            lease_seconds=lease_seconds,
            limit=len(ids),
            order=ops.c.id,
        )
    if extra > 0:
        claimed += _claim(
            session,
            and_(_due(), _lease_free()),
            worker=worker,
            lease_seconds=lease_seconds,
            limit=extra,
            order=ops.c.next_attempt_at,
        )
    return claimed


def claim_unresolved(
    session: Session, *, worker: str, lease_seconds: float, limit: int
) -> list[Claimed]:
    """Lease ``unknown`` operations due for a look, and ``submitted`` ones whose lease expired.

    For unknown operations ``next_attempt_at`` is the time of the next look (the reconciler
    backs off); it never means a send.
    """
    where = or_(
        and_(
            ops.c.state == State.UNKNOWN.value,
            ops.c.next_attempt_at <= db_now(),
            _lease_free(),
        ),
        and_(ops.c.state == State.SUBMITTED.value, ops.c.lease_until < db_now()),
    )
    return _claim(
        session, where, worker=worker, lease_seconds=lease_seconds, limit=limit,
        order=ops.c.next_attempt_at,
    )  # fmt: skip


def due_ids(session: Session, *, limit: int) -> list[int]:
    """Operations a worker should pick up now: planned and due, or submitted and abandoned."""
    planned = select(ops.c.id).where(_due(), _lease_free()).limit(limit)
    abandoned = (
        select(ops.c.id)
        .where(ops.c.state == State.SUBMITTED.value, ops.c.lease_until < db_now())
        .limit(limit)
    )
    ids = list(session.scalars(planned)) + list(session.scalars(abandoned))
    return ids[:limit]


def run_cancelled(session: Session, run_id: int | None) -> bool:
    if run_id is None:
        return False
    return session.scalar(select(Run.cancel_requested_at).where(Run.id == run_id)) is not None


def reached_downstream(session: Session, operation_id: int) -> int:
    """Attempts of this operation that may have reached the downstream (not proven unsent)."""
    stmt = select(func.count()).where(
        Attempt.operation_id == operation_id,
        or_(Attempt.proof.is_(None), Attempt.proof != "not_sent"),
    )
    return int(session.scalar(stmt) or 0)


def move(
    session: Session,
    claimed: Claimed,
    event: Event,
    to: State,
    *,
    actor: str,
    reason: RejectReason | None = None,
    evidence: dict[str, Any] | None = None,
    values: dict[str, Any] | None = None,
    review: str | None = None,
    release: bool = True,
    receipt: dict[str, Any] | None = None,
    looked: bool = False,
) -> None:
    """Apply one transition under the claim's lease, with its event row (and review item).

    ``receipt`` is stored with its downstream reference; ``looked`` counts a lookup made.
    Raises StaleLease, writing nothing, when a newer claim holds the operation.
    """
    transition(claimed.state, event, to, reason)
    changes: dict[str, Any] = {
        "state": to.value,
        "reason": reason.value if reason else None,
        **(values or {}),
    }
    if receipt is not None:
        changes.update(receipt=receipt, downstream_ref=receipt.get("reference"))
    if looked:
        changes["lookups"] = ops.c.lookups + 1
    if to is State.UNKNOWN and claimed.state is not State.UNKNOWN:
        changes["unknown_since"] = db_now()
    if release:
        changes.update(lease_owner=None, lease_until=None)
    note = (reason.value if reason else None) or (evidence or {}).get("stop") or review
    _fenced_write(session, claimed, changes, to=to, actor=actor, note=note, evidence=evidence)
    if review is not None:
        open_review(session, claimed.id, claimed.tenant, review, evidence or {})


def _fenced_write(
    session: Session,
    claimed: Claimed,
    changes: dict[str, Any],
    *,
    to: State,
    actor: str,
    note: str | None,
    evidence: dict[str, Any] | None,
) -> None:
    """UPDATE the operation only if the claim's lease version and state still hold, then
    append its event row; StaleLease (nothing written) when a newer claim took over."""
    result = session.execute(
        update(ops)
        .where(
            ops.c.id == claimed.id,
            ops.c.lease_version == claimed.lease_version,
            ops.c.state == claimed.state.value,
        )
        .values(updated_at=db_now(), **changes)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        log.warning(
            "stale write refused",
            extra={"operation_id": claimed.id, "lease_version": claimed.lease_version},
        )
        raise StaleLease(operation_id=claimed.id, lease_version=claimed.lease_version)
    session.execute(
        insert(OperationEvent).values(
            operation_id=claimed.id,
            from_state=claimed.state.value,
            to_state=to.value,
            actor=actor,
            lease_version=claimed.lease_version,
            reason=note,
            evidence=evidence or None,
            at=db_now(),
        )
    )


def start_attempt(session: Session, claimed: Claimed, *, worker: str) -> Claimed:
    """Move a claimed planned operation to ``submitted`` and write its attempt row (no commit)."""
    number = claimed.attempts + 1
    move(
        session,
        claimed,
        Event.CLAIM,
        State.SUBMITTED,
        actor=worker,
        values={
            "attempts": number,
            "first_sent_at": func.coalesce(ops.c.first_sent_at, db_now()),
        },
        evidence={"attempt": number},
        release=False,
    )
    session.execute(
        insert(Attempt).values(
            operation_id=claimed.id,
            number=number,
            lease_version=claimed.lease_version,
            worker=worker,
            started_at=db_now(),
        )
    )
    first = claimed.first_sent_at or claimed.now
    return replace(claimed, state=State.SUBMITTED, attempts=number, first_sent_at=first)


def finish_attempt(
    session: Session,
    claimed: Claimed,
    *,
    proof: str,
    status_code: int | None,
    detail: dict[str, Any] | None,
) -> None:
    """Complete the current attempt row with what came back (no commit)."""
    session.execute(
        update(Attempt)
        .where(
            Attempt.operation_id == claimed.id,
            Attempt.number == claimed.attempts,
            Attempt.lease_version == claimed.lease_version,
        )
        .values(finished_at=db_now(), proof=proof, status_code=status_code, detail=detail)
    )


def open_review(
    session: Session, operation_id: int, tenant: str, reason: str, evidence: dict[str, Any]
) -> None:
    """Open a review item unless one is already open for the operation."""
    if open_review_id(session, operation_id) is None:
        session.execute(
            insert(ReviewItem).values(
                operation_id=operation_id,
                tenant=tenant,
                reason=reason,
                evidence=evidence,
                version=1,
                created_at=db_now(),
            )
        )


# -- reconciler and review queue ---------------------------------------------------------


@dataclass(frozen=True)
class Facts:
    """What the reconciler needs beyond the claim snapshot."""

    unknown_since: datetime | None
    lookups: int
    last_sent_at: datetime | None
    in_review: bool


def facts(session: Session, operation_id: int) -> Facts:
    row = session.execute(
        select(ops.c.unknown_since, ops.c.lookups).where(ops.c.id == operation_id)
    ).one()
    last = session.scalar(
        select(func.max(Attempt.started_at)).where(Attempt.operation_id == operation_id)
    )
    return Facts(
        row.unknown_since, row.lookups, last, open_review_id(session, operation_id) is not None
    )


def attempt_history(session: Session, operation_id: int) -> list[dict[str, Any]]:
    """Every attempt of an operation, oldest first, as evidence."""
    rows = session.scalars(
        select(Attempt).where(Attempt.operation_id == operation_id).order_by(Attempt.number)
    )
    return [
        {
            "number": a.number,
            "started_at": a.started_at.isoformat(),
            "finished_at": a.finished_at.isoformat() if a.finished_at else None,
            "proof": a.proof,
            "status_code": a.status_code,
            "detail": a.detail,
        }
        for a in rows
    ]


def touch(
    session: Session,
    claimed: Claimed,
    *,
    actor: str,
    note: str,
    recheck_at: datetime,
    looked: bool,
    evidence: dict[str, Any] | None = None,
    review: str | None = None,
) -> None:
    """Record a look that changed no state: when to look again, and the lookup tried.

    Fenced like ``move``; the event row has from = to, so the audit trail shows every lookup.
    """
    values: dict[str, Any] = {
        "next_attempt_at": recheck_at,
        "lease_owner": None,
        "lease_until": None,
    }
    if looked:
        values["lookups"] = ops.c.lookups + 1
    _fenced_write(
        session, claimed, values, to=claimed.state, actor=actor, note=note, evidence=evidence
    )
    if review is not None:
        open_review(session, claimed.id, claimed.tenant, review, evidence or {})


def open_review_id(session: Session, operation_id: int) -> int | None:
    return session.scalar(
        select(ReviewItem.id).where(
            ReviewItem.operation_id == operation_id, ReviewItem.resolved_at.is_(None)
        )
    )


def close_reviews(
    session: Session, operation_id: int, *, by: str, resolution: dict[str, Any]
) -> None:
    """Close the open review item of an operation that an automatic path has settled."""
    session.execute(
        update(ReviewItem)
        .where(ReviewItem.operation_id == operation_id, ReviewItem.resolved_at.is_(None))
        .values(
            resolved_at=db_now(),
            resolved_by=by,
            resolution=resolution,
            version=ReviewItem.version + 1,
        )
    )


def oldest_unknown_since(session: Session) -> datetime | None:
    value: datetime | None = session.scalar(
        select(func.min(ops.c.unknown_since)).where(ops.c.state == State.UNKNOWN.value)
    )
    return value


def db_time(session: Session) -> datetime:
    value: datetime | None = session.scalar(select(db_now()))
    assert value is not None
    return value


def settle_unknown(
    session: Session,
    operation_id: int,
    event: Event,
    to: State,
    *,
    actor: str,
    reason: RejectReason | None = None,
    receipt: dict[str, Any] | None = None,
    evidence: dict[str, Any] | None = None,
) -> bool:
    """Settle an ``unknown`` operation outside any claim (staff, or a staff-asked lookup).

    Bumps the fencing version, so a reconciler holding a lease can no longer write. Returns
    False, writing nothing, if the operation is no longer unknown.
    """
    transition(State.UNKNOWN, event, to, reason)
    row = session.execute(
        update(ops)
        .where(ops.c.id == operation_id, ops.c.state == State.UNKNOWN.value)
        .values(
            state=to.value,
            reason=reason.value if reason else None,
            receipt=receipt,
            downstream_ref=(receipt or {}).get("reference"),
            lease_version=ops.c.lease_version + 1,
            lease_owner=None,
            lease_until=None,
            updated_at=db_now(),
        )
        .returning(ops.c.lease_version)
    ).first()
    if row is None:
        return False
    session.execute(
        insert(OperationEvent).values(
            operation_id=operation_id,
            from_state=State.UNKNOWN.value,
            to_state=to.value,
            actor=actor,
            lease_version=row.lease_version,
            reason=reason.value if reason else event.value,
            evidence=evidence,
            at=db_now(),
        )
    )
    return True


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
    result = session.execute(
        update(ReviewItem)
        .where(
            ReviewItem.id == item_id,
            ReviewItem.version == version,
            ReviewItem.resolved_at.is_(None),
        )
        .values(
            resolved_at=db_now(),
            resolved_by=by,
            resolution=resolution,
            note=note,
            version=ReviewItem.version + 1,
        )
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def record_note(
    session: Session, operation_id: int, *, actor: str, note: str, evidence: dict[str, Any]
) -> None:
    """An event row that changes no state (a staff requery, for the audit trail)."""
    state = session.scalar(select(ops.c.state).where(ops.c.id == operation_id))
    session.execute(
        insert(OperationEvent).values(
            operation_id=operation_id,
            from_state=state,
            to_state=state,
            actor=actor,
            reason=note,
            evidence=evidence,
            at=db_now(),
        )
    )


# -- runs: cancellation ------------------------------------------------------------------


def request_run_cancel(session: Session, run_id: int, *, actor: str) -> bool:
    """Set the run's cancel flag once; False (nothing written) if it was already set."""
    result = session.execute(
        update(Run)
        .where(Run.id == run_id, Run.cancel_requested_at.is_(None))
        .values(cancel_requested_at=db_now(), cancelled_by=actor)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def cancel_planned(session: Session, run_id: int, *, actor: str) -> list[int]:
    """Move every ``planned`` operation of a run to ``cancelled``; returns their ids.

    One conditional UPDATE (``WHERE state = 'planned'``): an operation a worker has already
    moved to ``submitted`` is left alone. The fencing version is bumped, so a claim taken
    before this write can no longer record anything. One event row per operation.
    """
    transition(State.PLANNED, Event.CANCEL)  # the state table allows it, or this raises
    rows = session.execute(
        update(ops)
        .where(ops.c.run_id == run_id, ops.c.state == State.PLANNED.value)
        .values(
            state=State.CANCELLED.value,
            lease_version=ops.c.lease_version + 1,
            lease_owner=None,
            lease_until=None,
            updated_at=db_now(),
        )
        .returning(ops.c.id, ops.c.lease_version)
    ).all()
    for row in rows:
        session.execute(
            insert(OperationEvent).values(
                operation_id=row.id,
                from_state=State.PLANNED.value,
                to_state=State.CANCELLED.value,
                actor=actor,
                lease_version=row.lease_version,
                reason="run_cancelled",
                evidence={"sent": False},
                at=db_now(),
            )
        )
    return sorted(row.id for row in rows)
