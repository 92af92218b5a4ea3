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

The same watch measures each downstream's clock against the database's from the time every
answer says (``outbox.downstream_clock``): a lag beyond the clock margin is logged once per
episode, recorded (``downstream_clock_lags``: counted by the scrape as
``settled_downstream_clock_lag_episodes_total``, alerted) and allowed for by the reconciler's
fence (``reconciler.decide.Situation.quiet_at``), which reads the worst recent lag any process
measured (``downstream_lag``).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from outbox.clock import Reading, Step, StepDetector
from outbox.downstream_clock import DownstreamClocks, Lag, lag_of
from outbox.storage.clock_steps import clock_doubt_until, record_clock_step
from outbox.storage.downstream_clock import record_lag, worst_lag_since

log = logging.getLogger(__name__)

#: How far back the fence looks for a downstream's worst lag: every attempt a "not found" is
#: asked about was sent within its key retention, but a lag is a property of the clocks, not
#: of one attempt; an hour covers every lease many times over and forgets an episode that a
#: fixed clock ended (the lookup's own answer still says the lag now).
LAG_MEMORY = timedelta(hours=1)


class ClockWatch:
    """One process's watch on the database's clock: see steps, record them, say until when a
    "not found" is not to be trusted. Shared by the services of a process; thread-safe."""

    def __init__(self, *, margin: float = 1.0, window: float = 15.0) -> None:
        self.detector = StepDetector(margin=margin, window=window)
        self.downstreams = DownstreamClocks(margin=margin)

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

    def downstream_answered(
        self,
        downstream: str,
        said: datetime,
        resolution: float,
        *,
        db_before: datetime,
        db_after: datetime,
        by: str,
        sessions: sessionmaker[Session] | None = None,
    ) -> Lag:
        """An answer of ``downstream`` said its clock was ``said`` (``resolution`` seconds)
        between database times ``db_before`` and ``db_after``: measured, an episode beyond the
        clock margin logged (once as it begins, once as it ends) and recorded in ``sessions``
        (a transaction of its own; a failure is logged: this process allows for it anyway)."""
        lag = lag_of(said, resolution, db_before=db_before, db_after=db_after)
        was = self.downstreams.beyond(downstream)
        episode = self.downstreams.observe(downstream, lag)
        fields = {
            "downstream": downstream,
            "lag_seconds": round(lag.bound, 3),
            "margin_seconds": self.downstreams.margin,
            "detected_by": by,
        }
        if episode is not None and episode.begins:
            log.warning(
                "downstream clock behind the database's beyond the clock margin: a deadline "
                "fence by its clock holds later than the lease's end, and a 'not found' of a "
                "fenced kind waits for it",
                extra=fields,
            )
        elif was and not self.downstreams.beyond(downstream):
            log.info("downstream clock back within the clock margin", extra=fields)
        if episode is not None and sessions is not None:
            try:
                with sessions.begin() as session:
                    record_lag(session, episode, by=by)
            except Exception as exc:
                log.error(
                    "could not record a downstream's clock lag",
                    extra={"error": type(exc).__name__, "downstream": downstream},
                )
        return lag

    def downstream_lag(self, session: Session, downstream: str, now: datetime) -> float | None:
        """The worst lag (seconds) of ``downstream``'s clock behind the database's that this
        process measured or any process recorded in the last ``LAG_MEMORY`` (None: no answer
        said its time: the contract's clock margin is assumed)."""
        since = now - LAG_MEMORY
        known = [
            lag
            for lag in (
                self.downstreams.worst(downstream, since=since),
                worst_lag_since(session, downstream, since),
            )
            if lag is not None
        ]
        return max(known) if known else None
