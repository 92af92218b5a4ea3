"""Runs: the cancel flag, cancelling a run's planned operations, which runs are cancelled."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Table, bindparam, select, update
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
CANCELLED_AMONG = select(runs.c.id).where(
    runs.c.id.in_(bindparam("ids", expanding=True)), runs.c.cancel_requested_at.is_not(None)
)


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
