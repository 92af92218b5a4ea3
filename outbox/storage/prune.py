"""Pruning terminal operations (``outbox.prune``): which may go, their rows to archive, and
deleting them with everything that hangs on them.

An operation is *kept* while it is live (planned, submitted, unknown), in review, or has
changed or had an event since the cutoff; it is *held* while it is kept, or while another
operation of its run is kept (the run's report is read whole). A terminal operation that is
not held may be pruned, once no operation that stays compensates it (``outbox.prune`` checks
that, in batches, descending by id: a compensation always has a higher id than its original).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Table,
    and_,
    bindparam,
    delete,
    exists,
    func,
    not_,
    or_,
    select,
)
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import BindParameter

from outbox.models import Attempt, Operation, OperationEvent, Proposal, ReviewItem, Run
from outbox.states import LIVE, TERMINAL
from outbox.storage import tombstones

ops: Table = Operation.__table__  # type: ignore[assignment]
events: Table = OperationEvent.__table__  # type: ignore[assignment]
attempts: Table = Attempt.__table__  # type: ignore[assignment]
reviews: Table = ReviewItem.__table__  # type: ignore[assignment]
runs: Table = Run.__table__  # type: ignore[assignment]
proposals: Table = Proposal.__table__  # type: ignore[assignment]

_LIVE = sorted(s.value for s in LIVE)
_TERMINAL = sorted(s.value for s in TERMINAL)


def _kept(op: Any) -> ColumnElement[bool]:
    """``op`` (a table or an alias of operations) is live, in review, or was touched since
    ``:cutoff``."""
    review, event = reviews.alias(), events.alias()
    return or_(
        op.c.state.in_(_LIVE),
        op.c.updated_at >= bindparam("cutoff"),
        exists().where(review.c.operation_id == op.c.id, review.c.resolved_at.is_(None)),
        exists().where(event.c.operation_id == op.c.id, event.c.at >= bindparam("cutoff")),
    )


def _held(op: Any) -> ColumnElement[bool]:
    """``op`` is kept, or another operation of its run is."""
    mate = ops.alias()
    return or_(
        _kept(op),
        and_(
            op.c.run_id.is_not(None),
            exists().where(mate.c.run_id == op.c.run_id, _kept(mate)),
        ),
    )


_IDS: BindParameter[Any] = bindparam("ids", expanding=True)

#: Terminal operations not held, below ``:below``, highest id first (``:limit`` of them).
CANDIDATES = (
    select(ops.c.id, ops.c.run_id, ops.c.compensates_id)
    .where(ops.c.state.in_(_TERMINAL), ops.c.id < bindparam("below"), not_(_held(ops)))
    .order_by(ops.c.id.desc())
    .limit(bindparam("limit"))
)
#: The same, locked (PostgreSQL; SQLite's write lock is the transaction's): no event,
#: attempt or compensation can be added to them until the batch commits.
CANDIDATES_LOCKED = CANDIDATES.with_for_update(of=ops)
#: Those of ``:ids`` that are held.
HELD_AMONG = select(ops.c.id).where(ops.c.id.in_(_IDS), _held(ops))
#: Every compensation and the operation it offsets.
COMPENSATIONS = select(ops.c.id, ops.c.compensates_id).where(ops.c.compensates_id.is_not(None))
COUNT_EVENTS = select(func.count()).select_from(events).where(events.c.operation_id.in_(_IDS))
COUNT_ATTEMPTS = select(func.count()).select_from(attempts).where(attempts.c.operation_id.in_(_IDS))
COUNT_REVIEWS = select(func.count()).select_from(reviews).where(reviews.c.operation_id.in_(_IDS))
#: How many operations each of the runs ``:ids`` has.
RUN_SIZES = select(ops.c.run_id, func.count()).where(ops.c.run_id.in_(_IDS)).group_by(ops.c.run_id)
#: Those of the runs ``:ids`` a proposal names (they stay).
RUNS_PROPOSED = select(proposals.c.run_id).where(proposals.c.run_id.in_(_IDS)).distinct()

OPERATION_ROWS = select(ops).where(ops.c.id.in_(_IDS)).order_by(ops.c.id)
EVENT_ROWS = select(events).where(events.c.operation_id.in_(_IDS)).order_by(events.c.id)
ATTEMPT_ROWS = select(attempts).where(attempts.c.operation_id.in_(_IDS)).order_by(attempts.c.id)
REVIEW_ROWS = select(reviews).where(reviews.c.operation_id.in_(_IDS)).order_by(reviews.c.id)
RUN_ROWS = select(runs).where(runs.c.id.in_(_IDS))

DELETE_REVIEWS = delete(reviews).where(reviews.c.operation_id.in_(_IDS))
DELETE_EVENTS = delete(events).where(events.c.operation_id.in_(_IDS))
DELETE_ATTEMPTS = delete(attempts).where(attempts.c.operation_id.in_(_IDS))
#: Terminal ones only, whatever the caller passed.
DELETE_OPERATIONS = delete(ops).where(ops.c.id.in_(_IDS), ops.c.state.in_(_TERMINAL))
#: Those of the runs ``:ids`` no operation and no proposal names any more.
DELETE_EMPTY_RUNS = delete(runs).where(
    runs.c.id.in_(_IDS),
    ~exists().where(ops.c.run_id == runs.c.id),
    ~exists().where(proposals.c.run_id == runs.c.id),
)


def candidates(
    session: Session, *, cutoff: datetime, below: int, limit: int, lock: bool
) -> list[tuple[int, int | None, int | None]]:
    """``(id, run_id, compensates_id)`` of up to ``limit`` terminal operations below id
    ``below`` that nothing holds, highest id first; ``lock``: locked until the transaction
    ends."""
    stmt = CANDIDATES_LOCKED if lock else CANDIDATES
    rows = session.execute(stmt, {"cutoff": cutoff, "below": below, "limit": limit})
    return [(i, run_id, original) for i, run_id, original in rows]


def held_among(session: Session, ids: Collection[int], *, cutoff: datetime) -> set[int]:
    """Those of these operations that are held (``_held``)."""
    if not ids:
        return set()
    return set(session.scalars(HELD_AMONG, {"ids": sorted(ids), "cutoff": cutoff}))


def compensations(session: Session) -> dict[int, set[int]]:
    """Every operation that has compensations, with their ids."""
    found: dict[int, set[int]] = {}
    for comp, original in session.execute(COMPENSATIONS):
        found.setdefault(original, set()).add(comp)
    return found


def counts(session: Session, ids: Collection[int]) -> tuple[int, int, int]:
    """The events, attempts and review items of these operations."""
    params = {"ids": sorted(ids)}
    return (
        session.scalar(COUNT_EVENTS, params) or 0,
        session.scalar(COUNT_ATTEMPTS, params) or 0,
        session.scalar(COUNT_REVIEWS, params) or 0,
    )


def run_sizes(session: Session, run_ids: Collection[int]) -> dict[int, int]:
    """How many operations each of these runs has."""
    return {r: n for r, n in session.execute(RUN_SIZES, {"ids": sorted(run_ids)})}


def runs_proposed(session: Session, run_ids: Collection[int]) -> set[int]:
    """Those of these runs a proposal names."""
    return set(session.scalars(RUNS_PROPOSED, {"ids": sorted(run_ids)}))


def rows_of(session: Session, ids: Collection[int]) -> list[dict[str, Any]]:
    """Each operation's row with its events, attempts, review items and run, as mappings,
    lowest id first (what an archive keeps)."""
    params = {"ids": sorted(ids)}
    by_op: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for name, stmt in (("events", EVENT_ROWS), ("attempts", ATTEMPT_ROWS),
                       ("review_items", REVIEW_ROWS)):  # fmt: skip
        grouped: dict[int, list[dict[str, Any]]] = {}
        for row in session.execute(stmt, params).mappings():
            grouped.setdefault(row["operation_id"], []).append(dict(row))
        by_op[name] = grouped
    operations = [dict(row) for row in session.execute(OPERATION_ROWS, params).mappings()]
    run_ids = sorted({op["run_id"] for op in operations if op["run_id"] is not None})
    run_rows = {
        row["id"]: dict(row) for row in session.execute(RUN_ROWS, {"ids": run_ids}).mappings()
    }
    return [
        {
            "operation": op,
            **{name: grouped.get(op["id"], []) for name, grouped in by_op.items()},
            "run": run_rows.get(op["run_id"]) if op["run_id"] is not None else None,
        }
        for op in operations
    ]


def delete_operations(session: Session, ids: Sequence[int]) -> tuple[int, int, int, int]:
    """Delete these terminal operations with their review items, events and attempts, each
    operation leaving its tombstone (``outbox.storage.tombstones``) in the same transaction:
    how many of each ``(operations, events, attempts, review items)`` went."""
    params = {"ids": sorted(ids)}
    tombstones.write(session, ids)
    gone_reviews = _deleted(session, DELETE_REVIEWS, params)
    gone_events = _deleted(session, DELETE_EVENTS, params)
    gone_attempts = _deleted(session, DELETE_ATTEMPTS, params)
    gone_ops = _deleted(session, DELETE_OPERATIONS, params)
    return gone_ops, gone_events, gone_attempts, gone_reviews


def delete_empty_runs(session: Session, run_ids: Collection[int]) -> int:
    """Delete those of these runs that no operation and no proposal names: how many went."""
    if not run_ids:
        return 0
    return _deleted(session, DELETE_EMPTY_RUNS, {"ids": sorted(run_ids)})


def _deleted(session: Session, stmt: Any, params: dict[str, Any]) -> int:
    """How many rows the DELETE ``stmt`` deleted."""
    return int(session.execute(stmt, params).rowcount)  # type: ignore[attr-defined]
