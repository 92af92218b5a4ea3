"""A downstream's clock seen behind the database's beyond the clock margin: recording an
episode's rows, the worst recent lag, and the episodes begun (for the metrics scrape).

Rows are written by the process that measured the lag (``outbox.clock_steps.ClockWatch``), so
the reconciler's fence allows for what a worker saw, and every process's scrape counts them
(``outbox.storage.metrics``).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Table, bindparam, func, insert, select
from sqlalchemy.orm import Session

from outbox.downstream_clock import Episode
from outbox.models import DownstreamClockLag, UTCDateTime

lags: Table = DownstreamClockLag.__table__  # type: ignore[assignment]

#: One episode's change, as the process that saw it measured it.
RECORD_LAG = insert(lags).values(
    detected_at=bindparam("detected_at", type_=UTCDateTime()),
    downstream=bindparam("downstream"),
    lag_seconds=bindparam("lag_seconds"),
    begins=bindparam("begins"),
    detected_by=bindparam("detected_by"),
)
#: The worst lag recorded for one downstream at or after a time.
WORST_SINCE = select(func.max(lags.c.lag_seconds)).where(
    lags.c.downstream == bindparam("downstream"),
    lags.c.detected_at >= bindparam("since", type_=UTCDateTime()),
)


def record_lag(session: Session, episode: Episode, *, by: str) -> None:
    """Record ``episode`` in ``session`` (committed by the caller)."""
    session.execute(
        RECORD_LAG,
        {
            "detected_at": episode.at,
            "downstream": episode.downstream[:100],
            "lag_seconds": episode.lag,
            "begins": episode.begins,
            "detected_by": by[:100],
        },
    )


def worst_lag_since(session: Session, downstream: str, since: datetime) -> float | None:
    """The worst lag any process recorded for ``downstream`` at or after ``since`` (None:
    none)."""
    value: float | None = session.scalar(WORST_SINCE, {"downstream": downstream, "since": since})
    return value
