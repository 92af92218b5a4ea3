"""Every SQL statement that claims or transitions an operation.

Claims are conditional UPDATEs (state and an expired lease in the WHERE clause) that set a
lease in database time and bump the fencing version; every later write names that version
and changes nothing if a newer claim has taken over. ``SKIP LOCKED`` only reduces contention.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Connection,
    Float,
    Table,
    TextClause,
    and_,
    bindparam,
    func,
    insert,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session
from sqlalchemy.sql.expression import ClauseElement

from outbox.db import db_now
from outbox.errors import StaleLease
from outbox.models import Attempt, Operation, OperationEvent, ReviewItem, Run, UTCDateTime
from outbox.states import Event, RejectReason, State, transition

log = logging.getLogger(__name__)
ops: Table = Operation.__table__  # type: ignore[assignment]

#: Where a statement runs: a session's transaction, or a connection (on PostgreSQL the executor
#: uses an autocommit connection for the writes that are one statement each).
Bind = Session | Connection


def _conn(bind: Bind) -> Connection:
    return bind.connection() if isinstance(bind, Session) else bind


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
    bind: Bind, which: str, *, worker: str, lease_seconds: float, limit: int, **params: Any
) -> list[Claimed]:
    conn = _conn(bind)
    rows = conn.execute(
        _claim_statement(conn.dialect.name, which),
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
    hint for an operation another worker holds, claims nothing.
    """
    claimed: list[Claimed] = []
    if ids:
        claimed += _claim(
            bind,
            "hinted",
            worker=worker,
            lease_seconds=lease_seconds,
            limit=len(ids),
            ids=list(ids),
        )
    if extra > 0:
        claimed += _claim(bind, "due", worker=worker, lease_seconds=lease_seconds, limit=extra)
    return claimed


def claim_unresolved(
    session: Session, *, worker: str, lease_seconds: float, limit: int
) -> list[Claimed]:
    """Lease ``unknown`` operations due for a look, and ``submitted`` ones whose lease expired.

    For unknown operations ``next_attempt_at`` is the time of the next look (the reconciler
    backs off); it never means a send.
    """
    return _claim(session, "unresolved", worker=worker, lease_seconds=lease_seconds, limit=limit)


def renew_leases(
    bind: Bind, held: Sequence[tuple[int, int]], *, owner: str, lease_seconds: float
) -> set[int]:
    """Extend the leases ``owner`` still holds: ``held`` is (operation id, lease version).

    A lease is renewed only while it is the same claim (owner and version) and has not yet
    expired: an expired lease may already be another's to take, so it is never revived.
    Returns the ids renewed. Renewing never bumps the version, and never moves a send's bound:
    a send is bounded by the lease it was claimed with (``attempts.not_after``).
    """
    if not held:
        return set()
    stmt = (
        update(ops)
        .where(
            tuple_(ops.c.id, ops.c.lease_version).in_([tuple(h) for h in held]),
            ops.c.lease_owner == owner,
            ops.c.lease_until >= db_now(),
        )
        .values(lease_until=db_now(lease_seconds))
        .returning(ops.c.id)
    )
    return set(_conn(bind).scalars(stmt))


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


def cancelled_runs(bind: Bind, run_ids: Iterable[int | None]) -> set[int]:
    """Those of ``run_ids`` whose cancellation was requested (no statement when there are none)."""
    wanted = {r for r in run_ids if r is not None}
    if not wanted:
        return set()
    return set(
        _conn(bind).scalars(
            select(Run.id).where(Run.id.in_(wanted), Run.cancel_requested_at.is_not(None))
        )
    )


def reached_downstream(bind: Bind, operation_id: int) -> int:
    """Attempts of this operation that may have reached the downstream (not proven unsent)."""
    stmt = select(func.count()).where(
        Attempt.operation_id == operation_id,
        or_(Attempt.proof.is_(None), Attempt.proof != "not_sent"),
    )
    return int(_conn(bind).scalar(stmt) or 0)


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
    def settles_review(self) -> bool:
        """An operation leaving ``unknown`` takes its open review item with it: nobody could
        close an item whose operation is no longer unknown."""
        return self.claimed.state is State.UNKNOWN and self.to is not State.UNKNOWN

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


def apply(session: Bind, one: Move, *, actor: str) -> None:
    """``move`` for a Move value."""
    _fenced_write(
        session, one.claimed, one.changes(), to=one.to, actor=actor, note=one.note,
        evidence=one.evidence,
    )  # fmt: skip
    if one.review is not None:
        open_review(session, one.claimed.id, one.claimed.tenant, one.review, one.evidence or {})
    if one.settles_review:
        close_reviews(session, [one.claimed.id], by=actor, state=one.to)


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


def _fenced_write(
    session: Bind,
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
    conn = _conn(session)
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


def start_attempts(bind: Bind, claims: Sequence[Claimed], *, worker: str) -> list[Claimed]:
    """Move claimed planned operations to ``submitted`` and write their attempt rows.

    Returns the claims started, as they are now. One whose fence no longer holds (its lease
    expired and a newer claim took it over) is refused, logged and left out: it must not be
    sent. On PostgreSQL the whole batch is one statement, atomic by itself (an autocommit
    connection may run it); elsewhere the caller's transaction makes it atomic.
    """
    written = _write_moves(bind, _start_moves(claims), actor=worker, start=True)
    return _started(claims, written)


def _start_moves(claims: Sequence[Claimed]) -> list[Move]:
    return [
        Move(
            c,
            Event.CLAIM,
            State.SUBMITTED,
            evidence={"attempt": c.attempts + 1},
            values={"attempts": c.attempts + 1, "first_sent_at": _FIRST_SENT},
            release=False,
        )
        for c in claims
    ]


def _started(claims: Sequence[Claimed], written: set[int]) -> list[Claimed]:
    return [
        replace(
            c,
            state=State.SUBMITTED,
            attempts=c.attempts + 1,
            first_sent_at=c.first_sent_at or c.now,
        )
        for c in claims
        if c.id in written
    ]


def start_attempt(session: Bind, claimed: Claimed, *, worker: str) -> Claimed:
    """``start_attempts`` for one operation; StaleLease when its fence no longer holds."""
    started = start_attempts(session, [claimed], worker=worker)
    if not started:
        raise StaleLease(operation_id=claimed.id, lease_version=claimed.lease_version)
    return started[0]


def record(
    bind: Bind, moves: Sequence[Move], *, actor: str, finishes: Sequence[Finish] = ()
) -> set[int]:
    """Apply transitions, each under its own lease version, and complete their attempts.

    ``finishes`` complete the current attempt of the operations moved (those with a Finish).
    Returns the ids written. A move whose fence failed (a newer claim took the operation over)
    is refused, logged and skipped, and nothing of it is written (nor its Finish); the others
    are written. On PostgreSQL every operation's writes are in one statement per shape of
    change (usually one for the batch), each atomic by itself; elsewhere the caller's
    transaction makes them atomic.
    """
    by_id = {f.claimed.id: f for f in finishes}
    if len(by_id) != len(finishes) or not by_id.keys() <= {m.claimed.id for m in moves}:
        raise ValueError("one Finish per moved operation at most")
    return _write_moves(bind, moves, actor=actor, finishes=by_id)


def _write_moves(
    bind: Bind,
    moves: Sequence[Move],
    *,
    actor: str,
    start: bool = False,
    finishes: Mapping[int, Finish] | None = None,
) -> set[int]:
    """``moves`` with their events, review items, and started or finished attempts."""
    if not moves:
        return set()
    conn = _conn(bind)
    finishes = finishes or {}
    if conn.dialect.name != "postgresql":  # ``apply`` settles review items itself
        return _write_moves_each(conn, moves, actor=actor, start=start, finishes=finishes)
    written = _write_moves_pg(conn, moves, actor=actor, start=start, finishes=finishes)
    for one in moves:
        if one.settles_review and one.claimed.id in written:
            close_reviews(conn, [one.claimed.id], by=actor, state=one.to)
    return written


def _write_moves_each(
    conn: Connection,
    moves: Sequence[Move],
    *,
    actor: str,
    start: bool,
    finishes: Mapping[int, Finish],
) -> set[int]:
    """``_write_moves`` a few statements per operation (in the caller's transaction)."""
    written: set[int] = set()
    for one in moves:
        try:
            apply(conn, one, actor=actor)
        except StaleLease:
            continue
        written.add(one.claimed.id)
        c = one.claimed
        if start:
            conn.execute(
                _INSERT_ATTEMPT,
                {
                    "operation_id": c.id,
                    "number": c.attempts + 1,
                    "lease_version": c.lease_version,
                    "worker": actor,
                    "not_after": c.lease_until,
                },
            )
        if (f := finishes.get(c.id)) is not None:
            conn.execute(_FINISH, _finish_params(f))
    return written


def _finish_params(f: Finish) -> dict[str, Any]:
    return {
        "f_id": f.claimed.id,
        "f_number": f.claimed.attempts,
        "f_version": f.claimed.lease_version,
        "f_proof": f.proof,
        "f_status": f.status_code,
        "f_detail": f.detail,
    }


# -- PostgreSQL: a batch of moves in one statement ------------------------------------------

#: The shared expressions of ``Move.changes`` as SQL over the row being updated (``o``).
_PG_EXPRESSIONS = {
    id(_NOW): "clock_timestamp()",
    id(_LOOKUPS_PLUS_ONE): "o.lookups + 1",
    id(_FIRST_SENT): "coalesce(o.first_sent_at, clock_timestamp())",
}
_PG = postgresql.dialect()  # type: ignore[no-untyped-call]


def _json_text(value: Any) -> str:
    """A JSON column's value as SQLAlchemy's JSON type writes it (None is JSON null)."""
    return json.dumps(value)


def _write_moves_pg(
    conn: Connection,
    moves: Sequence[Move],
    *,
    actor: str,
    start: bool,
    finishes: Mapping[int, Finish],
) -> set[int]:
    """One data-modifying statement per shape of change (the UPDATE, fenced per row; the event
    rows, review items and attempt rows of the rows it updated), returning the ids updated."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for one in moves:
        changes = one.changes()
        plain = tuple(k for k in changes if not isinstance(changes[k], ClauseElement))
        exprs = tuple(
            (k, _PG_EXPRESSIONS[id(v)]) for k, v in changes.items() if isinstance(v, ClauseElement)
        )
        c = one.claimed
        finish = finishes.get(c.id)
        row: dict[str, Any] = {
            "id": c.id,
            "lease_version": c.lease_version,
            "from_state": c.state.value,
            "to_state": one.to.value,
            "note": one.note,
            "evidence": _json_text(one.evidence or None),
            "tenant": c.tenant,
            "review": one.review,
            "review_evidence": _json_text(one.evidence or {}),
            "number": c.attempts + 1,  # of the attempt started (a Finish names its own)
        }
        if finish is not None:
            row.update(
                number=finish.claimed.attempts,
                proof=finish.proof,
                status_code=finish.status_code,
                detail=_json_text(finish.detail),
            )
        for k in plain:
            row[f"p_{k}"] = _pg_value(k, changes[k])
        shape = (plain, exprs, one.review is not None, finish is not None)
        groups.setdefault(shape, []).append(row)
    written: set[int] = set()
    for (plain, exprs, review, finish), rows in groups.items():
        stmt = _pg_moves_statement(plain, exprs, review=review, start=start, finish=finish)
        written.update(
            conn.execute(stmt, {"rows": json.dumps(rows), "actor": actor}).scalars().all()
        )
    for one in moves:
        if one.claimed.id not in written:
            log.warning(
                "stale write refused",
                extra={"operation_id": one.claimed.id, "lease_version": one.claimed.lease_version},
            )
    return written


def _pg_value(column: str, value: Any) -> Any:
    """A plain value for the JSON rows the statement reads (see ``_pg_moves_statement``)."""
    kind = ops.c[column].type
    if isinstance(kind, JSON):
        return _json_text(value)
    if isinstance(kind, UTCDateTime):
        bound = kind.process_bind_param(value, _PG)
        return bound.isoformat() if bound is not None else None
    return value


@functools.lru_cache(maxsize=64)
def _pg_moves_statement(
    plain: tuple[str, ...],
    exprs: tuple[tuple[str, str], ...],
    *,
    review: bool,
    start: bool,
    finish: bool,
) -> TextClause:
    """The statement for one shape of change. Its rows come as one JSON array (``:rows``).

    Column names come from the model (``Move.changes``), never from input; JSON columns travel
    as text and are cast, so JSON null stays JSON null as the ORM writes it.
    """

    def sql_type(column: str) -> str:
        kind = ops.c[column].type
        return "text" if isinstance(kind, JSON) else str(kind.compile(dialect=_PG))

    def assigned(column: str) -> str:
        value = f"v.p_{column}"
        return f"CAST({value} AS json)" if isinstance(ops.c[column].type, JSON) else value

    fields = [
        "id bigint",
        "lease_version integer",
        "from_state text",
        "to_state text",
        "note text",
        "evidence text",
        "tenant text",
        "review text",
        "review_evidence text",
        "number integer",
        "proof text",
        "status_code integer",
        "detail text",
        *(f"p_{k} {sql_type(k)}" for k in plain),
    ]
    sets = [
        "updated_at = clock_timestamp()",
        *(f"{k} = {assigned(k)}" for k in plain),
        *(f"{k} = {sql}" for k, sql in exprs),
    ]
    # Names of the model's columns only: ``ops.c[...]`` above raised for any other.
    columns, assignments = ", ".join(fields), ", ".join(sets)
    rows = f"json_to_recordset(CAST(:rows AS json)) AS v({columns})"
    parts = [
        f"WITH v AS (SELECT * FROM {rows})",  # noqa: S608
        f"m AS (UPDATE operations AS o SET {assignments} FROM v"  # noqa: S608
        " WHERE o.id = v.id AND o.lease_version = v.lease_version AND o.state = v.from_state"
        " RETURNING o.id, o.lease_until)",
        "e AS (INSERT INTO operation_events"
        " (operation_id, from_state, to_state, actor, lease_version, reason, evidence, at)"
        " SELECT v.id, v.from_state, v.to_state, :actor, v.lease_version, v.note,"
        " CAST(v.evidence AS json), clock_timestamp() FROM v JOIN m ON m.id = v.id)",
    ]
    if review:  # at most one open item per operation (a partial unique index)
        parts.append(
            "r AS (INSERT INTO review_items"
            " (operation_id, tenant, reason, evidence, version, created_at)"
            " SELECT v.id, v.tenant, v.review, CAST(v.review_evidence AS json), 1,"
            " clock_timestamp() FROM v JOIN m ON m.id = v.id"
            " ON CONFLICT (operation_id) WHERE resolved_at IS NULL DO NOTHING)"
        )
    if start:
        parts.append(
            "a AS (INSERT INTO attempts"
            " (operation_id, number, lease_version, worker, started_at, not_after)"
            " SELECT v.id, v.number, v.lease_version, :actor, clock_timestamp(), m.lease_until"
            " FROM v JOIN m ON m.id = v.id)"
        )
    if finish:
        parts.append(
            "f AS (UPDATE attempts AS a SET finished_at = clock_timestamp(), proof = v.proof,"
            " status_code = v.status_code, detail = CAST(v.detail AS json)"
            " FROM v JOIN m ON m.id = v.id WHERE a.operation_id = v.id"
            " AND a.number = v.number AND a.lease_version = v.lease_version)"
        )
    return text(",\n".join(parts) + "\nSELECT id FROM m")


def open_review(
    session: Bind, operation_id: int, tenant: str, reason: str, evidence: dict[str, Any]
) -> None:
    """Open a review item unless one is already open for the operation."""
    if open_review_id(session, operation_id) is None:
        _conn(session).execute(
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
    #: per attempt: when it started, and the latest it may have been on the wire (its
    #: outcome's time, else its sender's lease end; None for attempts written before 0.2)
    sends: tuple[tuple[datetime, datetime | None], ...] = ()


def facts(session: Session, operation_id: int) -> Facts:
    row = session.execute(
        select(ops.c.unknown_since, ops.c.lookups).where(ops.c.id == operation_id)
    ).one()
    attempts = session.execute(
        select(Attempt.started_at, Attempt.not_after, Attempt.finished_at).where(
            Attempt.operation_id == operation_id
        )
    ).all()
    sends = tuple((a.started_at, _on_wire_until(a.not_after, a.finished_at)) for a in attempts)
    return Facts(
        row.unknown_since,
        row.lookups,
        max((start for start, _ in sends), default=None),
        open_review_id(session, operation_id) is not None,
        sends,
    )


def _on_wire_until(not_after: datetime | None, finished_at: datetime | None) -> datetime | None:
    """The earlier of the two bounds known: the attempt's lease end (no send outlives it) and
    the time its outcome was written (the request was over by then)."""
    bounds = [b for b in (not_after, finished_at) if b is not None]
    return min(bounds) if bounds else None


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
    session: Bind,
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


def open_review_id(session: Bind, operation_id: int) -> int | None:
    return _conn(session).scalar(
        select(ReviewItem.id).where(
            ReviewItem.operation_id == operation_id, ReviewItem.resolved_at.is_(None)
        )
    )


def close_reviews(bind: Bind, operation_ids: Sequence[int], *, by: str, state: State) -> None:
    """Close the open review items of operations that left ``unknown`` (to ``state``).

    Always after the operation's own row was written in the same transaction: the operation
    row, then its review item, is the one lock order (the reconciler's and staff's alike).
    """
    _conn(bind).execute(
        update(ReviewItem)
        .where(ReviewItem.operation_id.in_(operation_ids), ReviewItem.resolved_at.is_(None))
        .values(
            resolved_at=db_now(),
            resolved_by=by,
            resolution={"state": state.value, "by": by, "settled_with_operation": True},
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
    close_review: bool = True,
) -> bool:
    """Settle an ``unknown`` operation outside any claim (staff, or a staff-asked lookup).

    Bumps the fencing version, so a reconciler holding a lease can no longer write. Returns
    False, writing nothing, if the operation is no longer unknown. Its open review item is
    closed with it, unless ``close_review`` is False (the caller resolves the item itself,
    after this: the operation row first, then the item, is the one lock order).
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
    if close_review:
        close_reviews(session, [operation_id], by=actor, state=to)
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
