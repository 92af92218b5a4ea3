"""Steps of the database's clock that a process saw: recording one, and the newest one's end.

One row per process that saw a step (several may see the same one). Only the newest row
matters for trust: it was seen last, and its window is as long as every earlier one's, so it
ends after all of them (``outbox.clock_steps``). Counted by the metrics scrape
(``outbox.storage.metrics``).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Table, bindparam, insert, select
from sqlalchemy.orm import Session

from outbox.clock import Step
from outbox.models import ClockStep, UTCDateTime

steps: Table = ClockStep.__table__  # type: ignore[assignment]

#: One step, as the process that saw it measured it.
RECORD_STEP = insert(steps).values(
    detected_at=bindparam("detected_at", type_=UTCDateTime()),
    step_seconds=bindparam("step_seconds"),
    direction=bindparam("direction"),
    distrust_until=bindparam("distrust_until", type_=UTCDateTime()),
    detected_by=bindparam("detected_by"),
)
#: The newest step's end of distrust (by primary key: the last one recorded).
NEWEST_UNTIL = select(steps.c.distrust_until).order_by(steps.c.id.desc()).limit(1)


def record_clock_step(session: Session, step: Step, *, by: str) -> None:
    """Record ``step`` in ``session`` (committed by the caller)."""
    session.execute(
        RECORD_STEP,
        {
            "detected_at": step.at,
            "step_seconds": step.seconds,
            "direction": step.direction,
            "distrust_until": step.distrust_until,
            "detected_by": by[:100],
        },
    )


def clock_doubt_until(session: Session) -> datetime | None:
    """Until when no process may trust a "not found", after the newest step recorded (None:
    none ever was)."""
    value: datetime | None = session.scalar(NEWEST_UNTIL)
    return value
