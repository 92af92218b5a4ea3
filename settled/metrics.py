"""Prometheus metrics, read from the database at scrape time, at a cost that does not grow
with the tables.

The database is the only truth, and every process (web, worker) serves the same figures
without multiprocess bookkeeping. A scrape never reads the whole of a table:

- gauges read only the live part of ``operations`` through its partial indexes (planned;
  submitted and unknown), and the open review items through theirs: operations by live state,
  the age of the oldest unknown one, how long due work has waited for a worker or for the
  reconciler (it grows when no reconcile pass runs), the review queue depth;
- counters read only the events written since the previous scrape, by primary key: attempts
  by what their outcome proved, transitions by state, reconciler results. They count the
  events written since this process started (Prometheus' ``rate`` and ``increase`` expect
  counters that start at zero with the process; the first scrape reads back over the events
  since then). An event whose id is below one already counted but which was not yet
  committed (ids are handed out before commit) is looked for again at the next scrapes, for
  ``patience`` seconds (ids of rolled-back transactions never appear).

Every process serving these reports the same values: aggregate them with ``max``, not ``sum``
(the dashboard and alert rules in ``deploy/`` do).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from datetime import datetime, timedelta
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from sqlalchemy import ColumnElement, Select, and_, bindparam, func, select
from sqlalchemy.orm import Session, sessionmaker

from outbox.db import db_now
from outbox.models import Attempt, Operation, OperationEvent, ReviewItem
from outbox.states import State

LIVE = (State.PLANNED, State.SUBMITTED, State.UNKNOWN)
#: How long an event id missing below the counted ones is looked for (longer than any
#: transaction that writes events).
PATIENCE_SECONDS = 300.0
#: Most missing ids looked for at once (the oldest are given up first).
MAX_PENDING = 10_000

ops = Operation.__table__
events = OperationEvent.__table__
attempts = Attempt.__table__
reviews = ReviewItem.__table__

#: Each statement below is answered from an index (``tests/integration/test_metrics.py``
#: checks their plans on PostgreSQL): the partial indexes on live states, the open items'
#: partial unique index, the events' primary key and the attempts' (operation, number) key.
PLANNED = select(func.count(), func.min(ops.c.next_attempt_at), db_now()).where(
    ops.c.state == State.PLANNED.value
)
UNRESOLVED = (
    select(
        ops.c.state,
        func.count(),
        func.min(ops.c.unknown_since),
        func.min(ops.c.next_attempt_at),
        func.min(ops.c.lease_until),
    )
    .where(ops.c.state.in_([State.SUBMITTED.value, State.UNKNOWN.value]))
    .group_by(ops.c.state)
)
OPEN_REVIEWS = select(func.count()).select_from(reviews).where(reviews.c.resolved_at.is_(None))
LAST_EVENT = select(func.max(events.c.id))
#: The last event written before ``since`` (read backwards from the newest, once per process).
LAST_EVENT_BEFORE = select(func.max(events.c.id)).where(events.c.at < bindparam("since"))

_BY_RECONCILER = events.c.actor.like("reconciler:%")
#: The event that records an attempt's outcome is written in the same statement as the
#: attempt's completion, under the same lease version.
_OUTCOMES = events.join(
    attempts,
    and_(
        attempts.c.operation_id == events.c.operation_id,
        attempts.c.lease_version == events.c.lease_version,
    ),
)
_RECORDS_OUTCOME = and_(events.c.from_state == State.SUBMITTED.value, attempts.c.proof.is_not(None))


def _between(lo: int, hi: int) -> ColumnElement[bool]:
    return and_(events.c.id > lo, events.c.id <= hi)


def transitions_between(lo: int, hi: int) -> Select[Any]:
    """Events with ids in ``(lo, hi]`` by transition and by whether the reconciler wrote them."""
    columns = (events.c.from_state, events.c.to_state, events.c.reason, _BY_RECONCILER)
    return select(*columns, func.count()).where(_between(lo, hi)).group_by(*columns)


def outcomes_between(lo: int, hi: int) -> Select[Any]:
    """Attempts whose outcome an event with id in ``(lo, hi]`` recorded, by proof."""
    return (
        select(attempts.c.proof, func.count())
        .select_from(_OUTCOMES)
        .where(_between(lo, hi), _RECORDS_OUTCOME)
        .group_by(attempts.c.proof)
    )


def gaps_between(lo: int, hi: int) -> Select[Any]:
    """``(before, after)`` around each run of ids in ``(lo, hi]`` with no visible event."""
    previous = func.lag(events.c.id, 1, lo).over(order_by=events.c.id).label("previous")
    ids = select(events.c.id, previous).where(_between(lo, hi)).subquery()
    return select(ids.c.previous, ids.c.id).where(ids.c.id - ids.c.previous > 1)


def transitions_of(ids: Collection[int]) -> Select[Any]:
    return select(
        events.c.id, events.c.from_state, events.c.to_state, events.c.reason, _BY_RECONCILER
    ).where(events.c.id.in_(ids))


def outcomes_of(ids: Collection[int]) -> Select[Any]:
    return (
        select(events.c.id, attempts.c.proof)
        .select_from(_OUTCOMES)
        .where(events.c.id.in_(ids), _RECORDS_OUTCOME)
    )


class EventCounters:
    """Counters over the event table, advanced by primary-key ranges (module docstring)."""

    def __init__(
        self, *, patience: float = PATIENCE_SECONDS, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self.patience = patience
        self.monotonic = monotonic
        self.attempts: Counter[str] = Counter()
        self.transitions: Counter[tuple[str, str]] = Counter()
        self.reconcile: Counter[str] = Counter()
        self._born = monotonic()
        #: every event id up to this one was counted, is pending, or came before this process
        self._counted: int | None = None
        #: ids below ``_counted`` not seen yet, with the database time they were first missed
        self._pending: dict[int, datetime] = {}
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Event ids still looked for."""
        return len(self._pending)

    def advance(self, session: Session, now: datetime) -> None:
        """Count the events committed since the last call (``now``: database time)."""
        with self._lock:
            if self._counted is None:
                since = now - timedelta(seconds=self.monotonic() - self._born)
                self._counted = session.scalar(LAST_EVENT_BEFORE, {"since": since}) or 0
            missed_before = list(self._pending)
            last = session.scalar(LAST_EVENT) or 0
            if last > self._counted:
                lo, hi = self._counted, last
                seen = self._count_range(session, lo, hi)
                if seen < hi - lo:
                    for before, after in session.execute(gaps_between(lo, hi)):
                        for missing in range(before + 1, after):
                            self._pending[missing] = now
                self._counted = hi
            if missed_before:
                self._count_ids(session, missed_before)
            self._give_up(now)

    def _count_range(self, session: Session, lo: int, hi: int) -> int:
        seen = 0
        for frm, to, reason, by_reconciler, n in session.execute(transitions_between(lo, hi)):
            self._transition(frm, to, reason, by_reconciler, n)
            seen += n
        for proof, n in session.execute(outcomes_between(lo, hi)):
            self.attempts[proof] += n
        return seen

    def _count_ids(self, session: Session, ids: Iterable[int]) -> None:
        wanted = list(ids)
        for event_id, frm, to, reason, by_reconciler in session.execute(transitions_of(wanted)):
            self._transition(frm, to, reason, by_reconciler, 1)
            del self._pending[event_id]
        for _, proof in session.execute(outcomes_of(wanted)):
            self.attempts[proof] += 1

    def _transition(
        self, frm: str | None, to: str, reason: str | None, by_reconciler: bool, n: int
    ) -> None:
        self.transitions[(frm or "new", to)] += n
        if by_reconciler:
            self.reconcile[(reason or "looked") if frm == to else f"to_{to}"] += n

    def _give_up(self, now: datetime) -> None:
        """Stop looking for ids missing longer than ``patience`` (rolled back), and for the
        oldest beyond ``MAX_PENDING``."""
        expired = [i for i, t in self._pending.items() if (now - t).total_seconds() > self.patience]
        for i in expired:
            del self._pending[i]
        for i in sorted(self._pending)[: max(0, len(self._pending) - MAX_PENDING)]:
            del self._pending[i]


class SettledCollector(Collector):
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions
        self.counters = EventCounters()

    def collect(self) -> Iterator[Metric]:
        with self.sessions() as s:
            planned, oldest_due, now = s.execute(PLANNED).one()
            unresolved = {row[0]: row[1:] for row in s.execute(UNRESOLVED)}
            depth = s.scalar(OPEN_REVIEWS) or 0
            self.counters.advance(s, now)

        def age(since: datetime | None) -> float:
            return max(0.0, (now - since).total_seconds()) if since is not None else 0.0

        n_submitted, _, _, submitted_lease_end = unresolved.get(
            State.SUBMITTED.value, (0, None, None, None)
        )
        n_unknown, unknown_since, unknown_next_look, _ = unresolved.get(
            State.UNKNOWN.value, (0, None, None, None)
        )

        states = GaugeMetricFamily(
            "settled_operations",
            "Operations in a live state (planned, submitted, unknown).",
            labels=["state"],
        )
        for state, n in zip(LIVE, (planned, n_submitted, n_unknown), strict=True):
            states.add_metric([state.value], n)
        yield states
        yield GaugeMetricFamily(
            "settled_oldest_unknown_age_seconds",
            "Age of the oldest operation in state unknown (0 when none).",
            value=age(unknown_since),
        )
        yield GaugeMetricFamily("settled_review_queue_depth", "Open review items.", value=depth)
        yield GaugeMetricFamily(
            "settled_send_backlog_age_seconds",
            "How long the longest-waiting due planned operation has been due (0 when none).",
            value=age(oldest_due),
        )
        # An unknown operation is due for a look at next_attempt_at; a submitted one whose
        # worker died, once its lease ended.
        due_looks = [t for t in (unknown_next_look, submitted_lease_end) if t is not None]
        yield GaugeMetricFamily(
            "settled_reconcile_backlog_age_seconds",
            "How long the longest-waiting unresolved operation has been due for a look "
            "(0 when none): grows while no reconcile pass runs.",
            value=age(min(due_looks)) if due_looks else 0.0,
        )

        c = self.counters
        attempts_total = CounterMetricFamily(
            "settled_attempts",
            "Attempts by what their outcome proved, recorded since this process started.",
            labels=["outcome"],
        )
        for proof, n in sorted(c.attempts.items()):
            attempts_total.add_metric([proof], n)
        yield attempts_total
        transitions = CounterMetricFamily(
            "settled_transitions",
            "State changes of operations (from 'new' at intake) since this process started.",
            labels=["from_state", "to_state"],
        )
        for (frm, to), n in sorted(c.transitions.items()):
            transitions.add_metric([frm, to], n)
        yield transitions
        results = CounterMetricFamily(
            "settled_reconcile_results",
            "What reconciler passes concluded, per operation looked at, since this process "
            "started.",
            labels=["result"],
        )
        for result, n in sorted(c.reconcile.items()):
            results.add_metric([result], n)
        yield results


def registry(sessions: sessionmaker[Session]) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SettledCollector(sessions))
    return reg
