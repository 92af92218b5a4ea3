"""Tombstones of pruned operations: written by the prune in the transaction that deletes the
operations, read by intake, deleted only by ``outbox.tombstones.prune_tombstones``.

Why a replay can never slip between a prune and its tombstone (``(tenant, op_id)`` is unique
in each table, not across the two):

- A prune locks its operations, writes their tombstones and deletes them in one transaction,
  so a reader sees either the operation or its tombstone, never neither once it committed.
- Intake's INSERT inserts only where no tombstone is seen (``NOT_TOMBSTONED``, in the same
  statement: a replay costs no extra statement on the way in).
- On PostgreSQL that check reads the statement's snapshot, taken before the INSERT may wait:
  an INSERT that meets the unique key of an operation a prune is deleting waits for the prune
  and, once it committed, inserts. So the statement also returns ``TOMBSTONED``, a VOLATILE
  function (migration 0011) evaluated on the row it inserted, after that wait, with a snapshot
  of its own that sees the prune's commit; intake then deletes the row it just wrote
  (``UNDO_EVENTS``, ``UNDO_OPERATION``: two more statements, in that race only) and answers the
  replay from the tombstone. Under REPEATABLE READ or SERIALIZABLE the function sees the
  transaction's snapshot instead: run intake under READ COMMITTED (PostgreSQL's default).
- SQLite has one writer: the INSERT holds the write lock when it reads, so it reads the newest
  data, or fails (SQLITE_BUSY_SNAPSHOT) on a stale snapshot instead of inserting.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Table,
    bindparam,
    delete,
    exists,
    func,
    select,
    tuple_,
)
from sqlalchemy.orm import Session

from outbox.db import db_now
from outbox.models import Operation, OperationEvent, OperationTombstone
from outbox.states import TERMINAL

tombs: Table = OperationTombstone.__table__  # type: ignore[assignment]
ops: Table = Operation.__table__  # type: ignore[assignment]
events: Table = OperationEvent.__table__  # type: ignore[assignment]

#: the operation's columns a tombstone copies (``pruned_at`` is the prune's database time)
COPIED = (
    "tenant", "op_id", "kind", "fingerprint", "fingerprint_key_version", "idempotency_key",
    "state", "reason", "downstream_ref", "created_at",
)  # fmt: skip

#: Intake's condition: no tombstone for ``:tenant``, ``:op_id`` (the statement's own snapshot).
NOT_TOMBSTONED: ColumnElement[bool] = ~exists().where(
    tombs.c.tenant == bindparam("tenant"), tombs.c.op_id == bindparam("op_id")
)


def tombstoned(tenant: ColumnElement[str], op_id: ColumnElement[str]) -> ColumnElement[bool]:
    """PostgreSQL: whether ``(tenant, op_id)`` has a tombstone, read when evaluated with a
    snapshot of its own (``settled_tombstoned``, migration 0011)."""
    return func.settled_tombstoned(tenant, op_id, type_=Boolean())


#: A tombstone for each of the terminal operations ``:ids``, at database time.
WRITE_TOMBSTONES = tombs.insert().from_select(
    [*COPIED, "pruned_at"],
    select(*(ops.c[name] for name in COPIED), db_now()).where(
        ops.c.id.in_(bindparam("ids", expanding=True)),
        ops.c.state.in_(sorted(s.value for s in TERMINAL)),
    ),
)
#: The tombstone of ``:tenant``, ``:op_id``.
FIND_TOMBSTONE = select(OperationTombstone).where(
    OperationTombstone.tenant == bindparam("tenant"),
    OperationTombstone.op_id == bindparam("op_id"),
)
#: How many tombstones were written before ``:cutoff``.
COUNT_OLDER = select(func.count()).select_from(tombs).where(tombs.c.pruned_at < bindparam("cutoff"))
#: Up to ``:limit`` of the tombstones written before ``:cutoff``.
DELETE_OLDER = delete(tombs).where(
    tuple_(tombs.c.tenant, tombs.c.op_id).in_(
        select(tombs.c.tenant, tombs.c.op_id)
        .where(tombs.c.pruned_at < bindparam("cutoff"))
        .limit(bindparam("limit"))
        .scalar_subquery()
    )
)
#: The race's undo (PostgreSQL): the row intake's INSERT wrote, and its ``created`` event.
UNDO_EVENTS = delete(events).where(events.c.operation_id == bindparam("id"))
UNDO_OPERATION = delete(ops).where(ops.c.id == bindparam("id"))


def write(session: Session, ids: Sequence[int]) -> int:
    """A tombstone for each of these terminal operations: how many were written."""
    if not ids:
        return 0
    return int(session.execute(WRITE_TOMBSTONES, {"ids": sorted(ids)}).rowcount)  # type: ignore[attr-defined]


def find(session: Session, tenant: str, op_id: str) -> OperationTombstone | None:
    """The tombstone of ``(tenant, op_id)`` (None: it was never pruned)."""
    found: OperationTombstone | None = session.scalars(
        FIND_TOMBSTONE, {"tenant": tenant, "op_id": op_id}
    ).one_or_none()
    return found


def count_older(session: Session, cutoff: datetime) -> int:
    """How many tombstones were written before ``cutoff``."""
    return int(session.scalar(COUNT_OLDER, {"cutoff": cutoff}) or 0)


def delete_older(session: Session, cutoff: datetime, limit: int) -> int:
    """Delete up to ``limit`` tombstones written before ``cutoff``: how many went."""
    return int(session.execute(DELETE_OLDER, {"cutoff": cutoff, "limit": limit}).rowcount)  # type: ignore[attr-defined]


def undo_insert(session: Session, operation_id: int) -> None:
    """Delete the operation intake's INSERT just wrote in ``session``'s transaction, with its
    ``created`` event (the race above)."""
    session.execute(UNDO_EVENTS, {"id": operation_id})
    session.execute(UNDO_OPERATION, {"id": operation_id})
