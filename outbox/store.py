"""Every SQL statement that claims or transitions an operation.

Claims are conditional UPDATEs (state and an expired lease in the WHERE clause) that set a
lease in database time and bump the fencing version; every later write names that version
and changes nothing if a newer claim has taken over. ``SKIP LOCKED`` only reduces contention.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy import Float, Table, and_, bindparam, func, insert, or_, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.expression import ClauseElement

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


#: SQL expressions the hot paths share: one object each, so statements built from them can be
#: cached by shape (see ``_fenced_update``) and compared by identity.
_NOW = db_now()
_LOOKUPS_PLUS_ONE = ops.c.lookups + 1
_FIRST_SENT = func.coalesce(ops.c.first_sent_at, _NOW)
#: by id: the shared expressions live as long as the module, so their ids never get reused
_SHARED = {id(e): e for e in (_NOW, _LOOKUPS_PLUS_ONE, _FIRST_SENT)}


@functools.lru_cache(maxsize=32)
def _claim_statement(dialect: str, which: str) -> Any:
    """The claim UPDATE for ``which`` ("hinted", "due", "unresolved"), built once per dialect.

    Parameters: ``worker``, ``lease_seconds``, ``limit`` and, for "hinted", ``ids``.
    """
    order: Any = ops.c.next_attempt_at
    if which == "hinted":
        where = and_(
            ops.c.id.in_(bindparam("ids", expanding=True)),
            or_(_due(), ops.c.state == State.SUBMITTED.value),
            _lease_free(),
        )
        order = ops.c.id
    elif which == "due":
        where = and_(_due(), _lease_free())
    elif which == "unresolved":
        where = or_(
            and_(
                ops.c.state == State.UNKNOWN.value,
                ops.c.next_attempt_at <= db_now(),
                _lease_free(),
            ),
            and_(ops.c.state == State.SUBMITTED.value, ops.c.lease_until < db_now()),
        )
    else:
        raise ValueError(which)
    candidates = select(ops.c.id).where(where).order_by(order).limit(bindparam("limit"))
    if dialect == "postgresql":
        candidates = candidates.with_for_update(skip_locked=True)
    return (
        update(ops)
        # The WHERE clause is repeated on the row itself: this, not the sub-select, is what
        # makes the claim exclusive.
        .where(ops.c.id.in_(candidates.scalar_subquery()), where)
        .values(
            lease_owner=bindparam("worker"),
            lease_until=db_now(bindparam("lease_seconds", type_=Float())),
            lease_version=ops.c.lease_version + 1,
        )
        .returning(*_COLUMNS, _NOW.label("now"))
    )


def _claim(
    session: Session, which: str, *, worker: str, lease_seconds: float, limit: int, **params: Any
) -> list[Claimed]:
    stmt = _claim_statement(session.get_bind().dialect.name, which)
    rows = session.connection().execute(
        stmt, {"worker": worker, "lease_seconds": float(lease_seconds), "limit": limit, **params}
    )
    return [Claimed(**{**row, "state": State(row["state"])}) for row in rows.mappings()]


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
        claimed += _claim(
            session,
            "hinted",
            worker=worker,
            lease_seconds=lease_seconds,
            limit=len(ids),
            ids=list(ids),
        )
    if extra > 0:
        claimed += _claim(session, "due", worker=worker, lease_seconds=lease_seconds, limit=extra)
    return claimed


def claim_unresolved(
    session: Session, *, worker: str, lease_seconds: float, limit: int
) -> list[Claimed]:
    """Lease ``unknown`` operations due for a look, and ``submitted`` ones whose lease expired.

    For unknown operations ``next_attempt_at`` is the time of the next look (the reconciler
    backs off); it never means a send.
    """
    return _claim(session, "unresolved", worker=worker, lease_seconds=lease_seconds, limit=limit)


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


def cancelled_runs(session: Session, run_ids: Iterable[int | None]) -> set[int]:
    """Those of ``run_ids`` whose cancellation was requested (no statement when there are none)."""
    wanted = {r for r in run_ids if r is not None}
    if not wanted:
        return set()
    return set(
        session.scalars(
            select(Run.id).where(Run.id.in_(wanted), Run.cancel_requested_at.is_not(None))
        )
    )


def reached_downstream(session: Session, operation_id: int) -> int:
    """Attempts of this operation that may have reached the downstream (not proven unsent)."""
    stmt = select(func.count()).where(
        Attempt.operation_id == operation_id,
        or_(Attempt.proof.is_(None), Attempt.proof != "not_sent"),
    )
    return int(session.scalar(stmt) or 0)


@dataclass(frozen=True)
class Move:
    """One transition under a claim's lease, as a value (see ``move`` for the fields)."""

    claimed: Claimed
    event: Event
    to: State
    reason: RejectReason | None = None
    evidence: dict[str, Any] | None = None
    values: Mapping[str, Any] = field(default_factory=dict)
    review: str | None = None
    release: bool = True
    receipt: dict[str, Any] | None = None
    looked: bool = False

    def changes(self) -> dict[str, Any]:
        """The columns this transition writes (values or SQL expressions)."""
        transition(self.claimed.state, self.event, self.to, self.reason)
        changes: dict[str, Any] = {
            "state": self.to.value,
            "reason": self.reason.value if self.reason else None,
            **self.values,
        }
        if self.receipt is not None:
            changes.update(receipt=self.receipt, downstream_ref=self.receipt.get("reference"))
        if self.looked:
            changes["lookups"] = _LOOKUPS_PLUS_ONE
        if self.to is State.UNKNOWN and self.claimed.state is not State.UNKNOWN:
            changes["unknown_since"] = _NOW
        if self.release:
            changes.update(lease_owner=None, lease_until=None)
        return changes

    @property
    def note(self) -> str | None:
        """The event row's reason: the reject reason, else why it stopped, else the review."""
        return (
            (self.reason.value if self.reason else None)
            or (self.evidence or {}).get("stop")
            or self.review
        )


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
    apply(
        session,
        Move(claimed, event, to, reason, evidence, values or {}, review, release, receipt, looked),
        actor=actor,
    )


def apply(session: Session, one: Move, *, actor: str) -> None:
    """``move`` for a Move value."""
    _fenced_write(
        session, one.claimed, one.changes(), to=one.to, actor=actor, note=one.note,
        evidence=one.evidence,
    )  # fmt: skip
    if one.review is not None:
        open_review(session, one.claimed.id, one.claimed.tenant, one.review, one.evidence or {})


_statements: dict[tuple[tuple[str, ...], tuple[tuple[str, int], ...]], Any] = {}
_statements_lock = threading.Lock()


def _fenced_update(plain: tuple[str, ...], exprs: Mapping[str, Any]) -> Any:
    """The fenced UPDATE writing ``plain`` columns from ``m_<column>`` parameters and
    ``exprs`` as given; cached by shape when every expression is one of the shared ones."""
    cacheable = all(_SHARED.get(id(v)) is v for v in exprs.values())
    key = (plain, tuple((k, id(v)) for k, v in exprs.items()))
    stmt = _statements.get(key) if cacheable else None
    if stmt is None:
        stmt = (
            update(ops)
            .where(
                ops.c.id == bindparam("m_id"),
                ops.c.lease_version == bindparam("m_version"),
                ops.c.state == bindparam("m_from"),
            )
            .values(updated_at=_NOW, **{k: bindparam(f"m_{k}") for k in plain}, **exprs)
        )
        if cacheable:
            with _statements_lock:
                if len(_statements) < 256:  # shapes are few; never grow without bound
                    _statements[key] = stmt
    return stmt


_events_table: Table = OperationEvent.__table__  # type: ignore[assignment]
_INSERT_EVENT = insert(_events_table).values(at=_NOW)
_attempts_table: Table = Attempt.__table__  # type: ignore[assignment]
_INSERT_ATTEMPT = insert(_attempts_table).values(started_at=_NOW)


class StaleBatch(Exception):
    """A fence of ``move_many`` did not hold; the caller rolls back and moves one by one."""


def move_many(session: Session, moves: Sequence[Move], *, actor: str) -> None:
    """Apply several transitions in a few statements, each fenced by its own lease version.

    One executemany UPDATE per shape of change (usually one), one multi-row event insert.
    A single move is applied by ``move`` (StaleLease, logged, when its fence fails). For
    several, the fences are checked by the total row count: when any failed, StaleBatch is
    raised and the caller must roll the transaction back and apply the moves one by one with
    ``move``, which tells exactly which operation a newer claim took over. The rows updated
    stay locked until the commit, so the event rows written after the check describe them.
    """
    if len(moves) <= 1:
        for one in moves:  # one operation: StaleLease says which, as ``move`` does
            apply(session, one, actor=actor)
        return
    groups: dict[tuple[tuple[str, ...], tuple[tuple[str, int], ...]], list[dict[str, Any]]] = {}
    exprs_of: dict[tuple[tuple[str, ...], tuple[tuple[str, int], ...]], dict[str, Any]] = {}
    for one in moves:
        plain, exprs, row = _fenced_params(one.claimed, one.changes())
        shape = (plain, tuple((k, id(v)) for k, v in exprs.items()))
        exprs_of.setdefault(shape, exprs)
        groups.setdefault(shape, []).append(row)
    conn = session.connection()
    for shape, rows in groups.items():
        if conn.execute(_fenced_update(shape[0], exprs_of[shape]), rows).rowcount != len(rows):
            raise StaleBatch
    conn.execute(
        _INSERT_EVENT,
        [
            _event_row(one.claimed, one.to, actor=actor, note=one.note, evidence=one.evidence)
            for one in moves
        ],
    )
    for one in moves:
        if one.review is not None:
            open_review(session, one.claimed.id, one.claimed.tenant, one.review, one.evidence or {})


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
    plain, exprs, params = _fenced_params(claimed, changes)
    conn = session.connection()
    if conn.execute(_fenced_update(plain, exprs), params).rowcount != 1:
        log.warning(
            "stale write refused",
            extra={"operation_id": claimed.id, "lease_version": claimed.lease_version},
        )
        raise StaleLease(operation_id=claimed.id, lease_version=claimed.lease_version)
    conn.execute(_INSERT_EVENT, _event_row(claimed, to, actor=actor, note=note, evidence=evidence))


def _fenced_params(
    claimed: Claimed, changes: Mapping[str, Any]
) -> tuple[tuple[str, ...], dict[str, Any], dict[str, Any]]:
    """Split ``changes`` into the plain columns, the SQL expressions, and the parameters of
    ``_fenced_update`` (the plain values and the claim's fence)."""
    exprs = {k: v for k, v in changes.items() if isinstance(v, ClauseElement)}
    plain = tuple(k for k in changes if k not in exprs)
    params = {f"m_{k}": changes[k] for k in plain}
    params.update(m_id=claimed.id, m_version=claimed.lease_version, m_from=claimed.state.value)
    return plain, exprs, params


def _event_row(
    claimed: Claimed, to: State, *, actor: str, note: str | None, evidence: dict[str, Any] | None
) -> dict[str, Any]:
    """The parameters of ``_INSERT_EVENT`` for one transition under ``claimed``'s lease."""
    return {
        "operation_id": claimed.id,
        "from_state": claimed.state.value,
        "to_state": to.value,
        "actor": actor,
        "lease_version": claimed.lease_version,
        "reason": note,
        "evidence": evidence or None,
    }


def start_attempts(session: Session, claims: Sequence[Claimed], *, worker: str) -> list[Claimed]:
    """Move claimed planned operations to ``submitted`` and write their attempt rows.

    A few statements for the whole batch, no commit. The claims were taken in this same
    transaction, so their rows are locked and every fence holds (StaleBatch otherwise).
    """
    if not claims:
        return []
    move_many(
        session,
        [
            Move(
                c,
                Event.CLAIM,
                State.SUBMITTED,
                evidence={"attempt": c.attempts + 1},
                values={
                    "attempts": c.attempts + 1,
                    "first_sent_at": _FIRST_SENT,
                },
                release=False,
            )
            for c in claims
        ],
        actor=worker,
    )
    session.connection().execute(
        _INSERT_ATTEMPT,
        [
            {
                "operation_id": c.id,
                "number": c.attempts + 1,
                "lease_version": c.lease_version,
                "worker": worker,
            }
            for c in claims
        ],
    )
    return [
        replace(
            c,
            state=State.SUBMITTED,
            attempts=c.attempts + 1,
            first_sent_at=c.first_sent_at or c.now,
        )
        for c in claims
    ]


def start_attempt(session: Session, claimed: Claimed, *, worker: str) -> Claimed:
    """``start_attempts`` for one operation."""
    return start_attempts(session, [claimed], worker=worker)[0]


@dataclass(frozen=True)
class Finish:
    """What came back for the current attempt of a claimed operation."""

    claimed: Claimed
    proof: str
    status_code: int | None
    detail: dict[str, Any] | None


_FINISH = (
    update(Attempt)
    .where(
        Attempt.operation_id == bindparam("f_id"),
        Attempt.number == bindparam("f_number"),
        Attempt.lease_version == bindparam("f_version"),
    )
    .values(
        finished_at=db_now(),
        proof=bindparam("f_proof"),
        status_code=bindparam("f_status"),
        detail=bindparam("f_detail"),
    )
)


def finish_attempts(session: Session, finishes: Sequence[Finish]) -> None:
    """Complete the current attempt rows with what came back (one executemany, no commit)."""
    if not finishes:
        return
    session.connection().execute(
        _FINISH,
        [
            {
                "f_id": f.claimed.id,
                "f_number": f.claimed.attempts,
                "f_version": f.claimed.lease_version,
                "f_proof": f.proof,
                "f_status": f.status_code,
                "f_detail": f.detail,
            }
            for f in finishes
        ],
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
        values["lookups"] = _LOOKUPS_PLUS_ONE
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
