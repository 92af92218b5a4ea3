"""PostgreSQL: a batch of transitions in one static statement; steps on autocommit or in one
transaction.

The hand-written statements are named, static SQL in ``queries.sql``, loaded once by name
(``QUERIES``); their values come as bound parameters only. A batch of transitions travels as
one JSON array parameter unpacked by ``json_to_recordset``: one statement and one round trip
per batch whatever its size, atomic by itself, so a worker's outcome step needs no
transaction. Its claim step (the claim, then the start of its sends) is one transaction: one
commit, a WAL flush, instead of two. The statement has the parts the batch needs
(``PARTS``); its variants are made at import.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC
from itertools import combinations
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import (
    Connection,
    Integer,
    String,
    Table,
    TextClause,
    bindparam,
    case,
    cast,
    func,
    literal,
    literal_column,
    null,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from outbox.models import OperationEvent
from outbox.storage import tombstones
from outbox.storage.connection import Bind, run_twice
from outbox.storage.database import Storage
from outbox.storage.operations import INTAKE_RETURNS, intake_insert
from outbox.storage.replication import Replication, replication
from outbox.storage.tombstones import tombstoned
from outbox.storage.transitions import Finish, Transition

T = TypeVar("T")

events: Table = OperationEvent.__table__  # type: ignore[assignment]

QUERIES_FILE = Path(__file__).with_name("queries.sql")


def load_queries(path: Path = QUERIES_FILE) -> dict[str, str]:
    """The statements of ``path`` by name: each starts at a ``-- name: <name>`` line; comment
    lines are left out of the text sent."""
    queries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if stripped.startswith("-- name:"):
            current = queries.setdefault(stripped.removeprefix("-- name:").strip(), [])
        elif current is not None and stripped and not stripped.startswith("--"):
            current.append(line)
    return {name: "\n".join(lines) for name, lines in queries.items()}


QUERIES = load_queries()
_SERIALIZE = text(QUERIES["serialize"])
#: An order's lock is one of ``ORDER_STRIPES`` advisory locks in a two-key space of its own
#: (``ORDER_LOCK_SPACE``): a transaction that enqueues on thousands of orders holds at most
#: this many, well inside PostgreSQL's lock table (``max_locks_per_transaction`` x
#: connections); two orders on one stripe only wait for each other's approvals.
ORDER_LOCK_SPACE = 5_741_100
ORDER_STRIPES = 1024
_LOCK_ORDER = {
    False: text(QUERIES["lock_order"]),
    True: text(QUERIES["lock_order.shared"]),
}
#: The parts of ``write_transitions`` a batch may need, in the order they are written.
PARTS = ("open_reviews", "settle_reviews", "start_attempts", "finish_attempts")


def _write_transitions(parts: frozenset[str]) -> TextClause:
    """``write_transitions`` with the named ``parts`` (``queries.sql``)."""
    body = [QUERIES["write_transitions"]]
    body += [QUERIES[f"write_transitions.{p}"] for p in PARTS if p in parts]
    return text("\n".join([*body, QUERIES["write_transitions.end"]]))


#: Every variant of ``write_transitions``, made once at import: one per set of parts.
WRITE_TRANSITIONS = {
    frozenset(chosen): _write_transitions(frozenset(chosen))
    for n in range(len(PARTS) + 1)
    for chosen in combinations(PARTS, n)
}
#: The intake INSERT selects its row through the order's shared lock (``order_lock``; a NULL
#: key, for a kind with no order, takes none: the lock functions are strict).
_INSERT_NEW = intake_insert(
    pg_insert,
    lock=func.pg_advisory_xact_lock_shared(
        literal(ORDER_LOCK_SPACE),
        cast(
            func.hashtextextended(bindparam("order_lock", type_=String()), 0).op("&")(
                ORDER_STRIPES - 1
            ),
            Integer,
        ),
    ),
)


def created_event(inserted: Any) -> Any:
    """Intake in one statement: ``inserted`` (the INSERT ... RETURNING) as a data-modifying
    CTE, its ``created`` event row written by a second one from the row it returned (nothing
    on a conflict), and the new row's ``INTAKE_RETURNS`` selected from the first, with
    ``tombstoned``: whether a prune that the INSERT waited for left a tombstone of its
    ``(tenant, op_id)`` (``outbox.storage.tombstones``)."""
    new = inserted.cte("new")
    evidence = case(
        (new.c.correlation_id.is_(None), literal_column("'null'::json")),
        else_=func.json_build_object(literal_column("'correlation_id'"), new.c.correlation_id),
    )
    columns = ["operation_id", "from_state", "to_state", "actor", "lease_version", "reason",
               "evidence", "at"]  # fmt: skip
    row = select(
        new.c.id, null(), new.c.state, literal("intake"), null(), null(), evidence,
        new.c.created_at,
    )  # fmt: skip
    event = pg_insert(events).from_select(columns, row).cte("created")
    returned = [new.c[name] for name in INTAKE_RETURNS]
    return select(*returned, tombstoned(new.c.tenant, new.c.op_id).label("tombstoned")).add_cte(
        event
    )


_INSERT_OPERATION = created_event(_INSERT_NEW)


def _parts(rows: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    """The parts of ``write_transitions`` these rows need."""
    needed = set()
    for row in rows:
        if "review" in row:
            needed.add("open_reviews")
        if "resolution" in row:
            needed.add("settle_reviews")
        if row.get("start"):
            needed.add("start_attempts")
        if "proof" in row:
            needed.add("finish_attempts")
    return frozenset(needed)


def _json_text(value: Any) -> str:
    """A JSON column's value as SQLAlchemy's JSON type writes it (None is JSON null)."""
    return json.dumps(value)


def _row(t: Transition, finish: Finish | None, actor: str) -> dict[str, Any]:
    """One transition as an object of ``write_transitions``' ``:rows``."""
    row: dict[str, Any] = {
        "id": t.id,
        "lease_version": t.lease_version,
        "from_state": t.from_state.value,
        "to_state": t.to.value,
        "reason": t.reason.value if t.reason else None,
        "release": t.release,
        "note": t.event_reason,
        "evidence": _json_text(t.evidence or None),
    }
    if t.next_attempt_at is not None:
        if t.next_attempt_at.tzinfo is None:
            raise ValueError("naive datetime: Settled stores aware UTC datetimes only")
        row["next_attempt_at"] = t.next_attempt_at.astimezone(UTC).isoformat()
    if t.due_now:
        row["due_now"] = True
    if t.receipt is not None:
        row.update(receipt=_json_text(t.receipt), downstream_ref=t.receipt.get("reference"))
    if t.looked:
        row["looked"] = True
    if t.review is not None:
        row.update(review=t.review, review_evidence=_json_text(t.evidence or {}))
    if t.settles_review:
        row["resolution"] = _json_text(t.resolution(actor))
    if t.start:
        row.update(start=True, number=t.attempt_number)
    if finish is not None:
        row.update(
            number=finish.claimed.attempts,
            proof=finish.proof,
            status_code=finish.status_code,
            detail=_json_text(finish.detail),
        )
    return row


class PostgresStorage(Storage):
    """PostgreSQL: one statement per batch of transitions, worker steps on autocommit (or in
    one transaction, ``one_commit``)."""

    def _write(
        self,
        conn: Connection,
        transitions: Sequence[Transition],
        *,
        actor: str,
        finishes: Mapping[int, Finish],
    ) -> set[int]:
        rows = [_row(t, finishes.get(t.id), actor) for t in transitions]
        statement = WRITE_TRANSITIONS[_parts(rows)]
        params = {"rows": json.dumps(rows), "ids": [t.id for t in transitions], "actor": actor}
        result = conn.execute(statement, params)
        return set(result.scalars())

    def _insert_operation(
        self, session: Session, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        row = session.execute(_INSERT_OPERATION, params).one_or_none()
        if row is None:
            return None
        values = dict(row._mapping)
        if values.pop("tombstoned"):  # it waited for a prune of this op_id: a replay after all
            tombstones.undo_insert(session, values["id"])
            return None
        return values

    def serialize(self, session: Session, key: str) -> None:
        session.execute(_SERIALIZE, {"key": key})

    def lock_order(self, session: Session, key: str, *, shared: bool = False) -> None:
        params = {"key": key, "space": ORDER_LOCK_SPACE, "stripes": ORDER_STRIPES}
        session.execute(_LOCK_ORDER[shared], params)

    def replication(self, bind: Bind) -> Replication | None:
        return replication(bind)

    def step(self, work: Callable[[Connection], T], *, one_commit: bool = False) -> T:
        """On an autocommit connection: every write of a step is a single statement; with
        ``one_commit``, in one transaction."""

        def once() -> T:
            if one_commit:
                with self.engine.begin() as conn:
                    return work(conn)
            with self.engine.connect() as conn:
                return work(conn.execution_options(isolation_level="AUTOCOMMIT"))

        return run_twice(once)
