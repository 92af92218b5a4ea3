"""The overview support staff open first: operations by state, the age of the oldest
unknown one, the review queue's depth, the reconciler's latest passes, and the last hour's
operations settled per minute and their time to settle.

Counts cover only the tenants the member of staff may see. The bucketing is pure
(``per_minute``), so the chart's figures are tested without a database.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from outbox.storage import overview as reads
from outbox.storage.operations import db_time
from support.staff import Staff

audit = logging.getLogger("settled.audit")

WINDOW = timedelta(hours=1)


@dataclass(frozen=True)
class Minute:
    """One minute of the window: operations settled in it, and their median and 95th
    percentile time to settle (None: nothing settled in it)."""

    start: datetime
    settled: int
    median_seconds: float | None
    p95_seconds: float | None = None


def per_minute(
    settled: list[tuple[datetime, datetime]], *, end: datetime, minutes: int = 60
) -> list[Minute]:
    """``(settled at, created at)`` pairs bucketed into the ``minutes`` whole minutes that
    end with the one holding ``end``, oldest first."""
    last = end.replace(second=0, microsecond=0)
    first = last - timedelta(minutes=minutes - 1)
    buckets: list[list[float]] = [[] for _ in range(minutes)]
    for at, created in settled:
        index = int((at - first).total_seconds() // 60)
        if 0 <= index < minutes:
            buckets[index].append(max(0.0, (at - created).total_seconds()))
    return [
        Minute(first + timedelta(minutes=i), len(b), _median(b), _percentile(b, 95))
        for i, b in enumerate(buckets)
    ]


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _percentile(values: list[float], p: int) -> float | None:
    """The nearest-rank ``p``th percentile (a value that occurred, never an interpolation)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-p * len(ordered) // 100))  # ceil(p/100 * n)
    return ordered[rank - 1]


@dataclass
class Overview:
    sessions: sessionmaker[Session]

    def read(self, staff: Staff) -> dict[str, Any]:
        """The overview's figures, read at one database time."""
        audit.info("console overview", extra={"staff": staff.id})
        with self.sessions() as session:
            now = db_time(session)
            oldest = reads.oldest_unknown(session, staff.tenants)
            settled = reads.settled_since(session, now - WINDOW, staff.tenants)
            passes = reads.reconcile_passes(session, now - WINDOW)
            return {
                "now": now,
                "by_state": reads.counts_by_state(session, staff.tenants),
                "oldest_unknown_seconds": (now - oldest).total_seconds() if oldest else None,
                "review_depth": reads.review_depth(session, staff.tenants),
                "passes": [{"reconciler": a, "last_at": at, "events": n} for a, at, n in passes],
                "minutes": per_minute(settled, end=now),
                "settled_last_hour": len(settled),
            }
