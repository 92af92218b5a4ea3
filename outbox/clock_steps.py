"""Watching the database's clock for steps, in every process that reads it.

Every deadline is in database time measured on the monotonic clock (``outbox.clock``), so a
clock that is set instead of slewed breaks what a "not found" proves: after a forward step a
lease ends early in database time while its sender still measures its bound from an earlier
reading, and the reconciler could trust a "not found" while the request is still on the wire.
Each reading a process takes anyway (a worker's claim, a reconciler's pass, a staff lookup) is
fed to one ``StepDetector`` per process; a step seen is logged, recorded in the database (so
every process, including one started after it, honours it) and counted by the metrics scrape
(``settled_db_clock_steps_total``). Until the newest step's window is over, the reconciler
and staff treat a "not found" as unproven (``reconciler.decide.not_found_doubt``).

What it cannot see: a step smaller than the clock margin, and a step between the last
reading of a process and its restart (its successor has no earlier reading to compare with).
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker

from outbox.clock import Reading, Step, StepDetector
from outbox.storage.clock_steps import clock_doubt_until, record_clock_step

log = logging.getLogger(__name__)


class ClockWatch:
    """One process's watch on the database's clock: see steps, record them, say until when a
    "not found" is not to be trusted. Shared by the services of a process; thread-safe."""

    def __init__(self, *, margin: float = 1.0, window: float = 15.0) -> None:
        self.detector = StepDetector(margin=margin, window=window)

    def seen(self, db_at: datetime, before: float, after: float, *, by: str) -> Step | None:
        """A reading of the database's clock taken between ``before`` and ``after`` (the
        caller's monotonic clock); the step it shows, logged, or None."""
        step = self.detector.observe(Reading(db_at, before, after))
        if step is not None:
            log.warning(
                "database clock stepped: a 'not found' proves nothing until every send in "
                "flight at the step is over",
                extra={
                    "step_seconds": round(step.seconds, 3),
                    "direction": step.direction,
                    "distrust_until": step.distrust_until.isoformat(),
                    "detected_by": by,
                },
            )
        return step

    def record(self, session: Session, step: Step, *, by: str) -> None:
        """Record ``step`` in ``session`` (committed by the caller), for every process."""
        record_clock_step(session, step, by=by)

    def record_now(self, sessions: sessionmaker[Session], step: Step, *, by: str) -> None:
        """Record ``step`` in a transaction of its own; a failure is logged (this process
        distrusts "not found" anyway; others see the next step recorded)."""
        try:
            with sessions.begin() as session:
                self.record(session, step, by=by)
        except Exception as exc:
            log.error(
                "could not record a step of the database clock",
                extra={"error": type(exc).__name__},
            )

    def doubt_until(self, session: Session) -> datetime | None:
        """Until when a "not found" must not be trusted (database time): after the newest
        step recorded by any process, or seen by this one (None: no step is known)."""
        known = [t for t in (clock_doubt_until(session), self.detector.distrust_until()) if t]
        return max(known) if known else None
