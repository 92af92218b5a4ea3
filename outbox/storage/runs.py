"""Runs: finding one, its operations, the cancel flag, cancelling its planned operations."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Table, bindparam, or_, select, update
from sqlalchemy.orm import Session

from outbox.db import db_now
from outbox.models import Operation, Run
from outbox.states import Event, State
from outbox.storage.connection import Bind, connection_of
from outbox.storage.database import Storage
from outbox.storage.transitions import Transition, Unclaimed

ops: Table = Operation.__table__  # type: ignore[assignment]
runs: Table = Run.__table__  # type: ignore[assignment]

REQUEST_CANCEL = (
    update(runs)
    .where(runs.c.id == bindparam("run_id"), runs.c.cancel_requested_at.is_(None))
    .values(cancel_requested_at=db_now(), cancelled_by=bindparam("actor"))
)
PLANNED_OF_RUN = (
    select(ops.c.id)
    .where(ops.c.run_id == bindparam("run_id"), ops.c.state == State.PLANNED.value)
    .order_by(ops.c.id)
)
FIND_RUN = select(Run).where(Run.tenant == bindparam("tenant"), Run.handle == bindparam("handle"))
_IN_RUN = select(Operation.id).where(Operation.run_id == bindparam("run_id")).scalar_subquery()
#: A run's operations, and compensations enqueued (in any run) for them, oldest first.
RUN_OPERATIONS = (
    select(Operation)
    .where(
        Operation.tenant == bindparam("tenant"),
        or_(Operation.run_id == bindparam("run_id"), Operation.compensates_id.in_(_IN_RUN)),
    )
    .order_by(Operation.id)
)
CANCELLED_AMONG = select(runs.c.id).where(
    runs.c.id.in_(bindparam("ids", expanding=True)), runs.c.cancel_requested_at.is_not(None)
)


def add_run(session: Session, *, tenant: str, handle: str, title: str | None) -> Run:
    """A new run's row in ``session`` (flushed: it has its id; never committed)."""
    run = Run(tenant=tenant, handle=handle, title=title)
    session.add(run)
    session.flush()
    return run


def find_run(session: Session, tenant: str, handle: str) -> Run | None:
    """Run ``handle`` of ``tenant``, loaded into ``session`` (None: no such run)."""
    found: Run | None = session.scalars(
        FIND_RUN, {"tenant": tenant, "handle": handle}
    ).one_or_none()
    return found


def run(session: Session, run_id: int) -> Run | None:
    """The run with this primary key, loaded into ``session``."""
    return session.get(Run, run_id)


def run_operations(session: Session, run: Run) -> list[Operation]:
    """A run's operations, and the compensations enqueued for them elsewhere, oldest first."""
    return list(session.scalars(RUN_OPERATIONS, {"tenant": run.tenant, "run_id": run.id}))


def request_run_cancel(session: Session, run_id: int, *, actor: str) -> bool:
    """Set the run's cancel flag once; False (nothing written) if it was already set."""
    result = session.connection().execute(REQUEST_CANCEL, {"run_id": run_id, "actor": actor})
    return result.rowcount == 1


def cancel_planned(storage: Storage, session: Session, run_id: int, *, actor: str) -> list[int]:
    """Move every ``planned`` operation of a run to ``cancelled``; returns their ids.

    Each write is fenced by ``state = 'planned'``: an operation a worker has already moved to
    ``submitted`` is left alone. The fencing version is bumped, so a claim taken before this
    write can no longer record anything. One event row per operation.
    """
    planned = session.connection().scalars(PLANNED_OF_RUN, {"run_id": run_id}).all()
    cancels = [
        Transition(
            Unclaimed(operation_id, State.PLANNED),
            Event.CANCEL,
            State.CANCELLED,
            evidence={"sent": False},
            note="run_cancelled",
        )
        for operation_id in planned
    ]
    return sorted(storage.write_transitions(session, cancels, actor=actor))


def cancelled_runs(bind: Bind, run_ids: Iterable[int | None]) -> set[int]:
    """Those of ``run_ids`` whose cancellation was requested (no statement when there are none)."""
    wanted = {r for r in run_ids if r is not None}
    if not wanted:
        return set()
    return set(connection_of(bind).scalars(CANCELLED_AMONG, {"ids": sorted(wanted)}))
