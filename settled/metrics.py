"""Prometheus metrics, read from the database at scrape time, at a cost that does not grow
with the tables.

The database is the only truth, and every process (web, worker) serves the same figures
without multiprocess bookkeeping. A scrape never reads the whole of a table:

- gauges read only the live part of ``operations`` through its partial indexes (planned;
  submitted and unknown), and the open review items through theirs: operations by live state,
  the due ones waiting for a worker (the send queue's depth), the age of the oldest unknown
  one, how long due work has waited for a worker or for the reconciler (it grows when no
  reconcile pass runs), the review queue depth;
- counters read only the events written since the previous scrape, by primary key: attempts
  by what their outcome proved, transitions by state, reconciler results, operations stopped
  by a fault of our own configuration (``outbox.states.ConfigFault``); and the steps of
  the database's clock recorded (``outbox.clock_steps``), by a primary-key range. They count the
  events written since this process started (Prometheus' ``rate`` and ``increase`` expect
  counters that start at zero with the process; the first scrape reads back over the events
  since then). An event whose id is below one already counted but which was not yet
  committed (ids are handed out before commit) is looked for again at the next scrapes, for
  ``patience`` seconds (ids of rolled-back transactions never appear).

The statements a scrape runs, and the index each reads, are in ``outbox.storage.metrics``.

Every process serving these reports the same values: aggregate them with ``max``, not ``sum``
(the dashboard and alert rules in ``deploy/`` do).

One counter is the app's own, not the database's: ``settled_hints_total{outcome}``, the hints
an app process published, failed to publish or skipped (``outbox.breaker``), on
prometheus_client's default registry of the process that publishes them (served as the app
serves its own metrics; sum it over the app's processes).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timedelta

from prometheus_client import Counter as ProcessCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from sqlalchemy.orm import Session, sessionmaker

from outbox.breaker import OUTCOMES as HINT_OUTCOMES
from outbox.states import ConfigFault, State
from outbox.storage import metrics as scrape
from outbox.storage import storage_for
from outbox.storage.replication import Replication

LIVE = (State.PLANNED, State.SUBMITTED, State.UNKNOWN)
#: The reasons of the events that stop an operation for a fault of our own configuration.
CONFIG_FAULTS = frozenset(f.value for f in ConfigFault)
#: How long an event id missing below the counted ones is looked for (longer than any
#: transaction that writes events).
PATIENCE_SECONDS = 300.0
#: Most missing ids looked for at once (the oldest are given up first).
MAX_PENDING = 10_000

HINTS = ProcessCounter(
    "settled_hints",
    "Hints this app process published after its commits, failed to publish (the broker did "
    "not take one within SETTLED_HINT_TIMEOUT) or skipped (for SETTLED_HINT_COOLDOWN_SECONDS "
    "after a failure); the sweeper sends the operations of those not published.",
    ["outcome"],
)
for _outcome in HINT_OUTCOMES:
    HINTS.labels(_outcome)  # each outcome shows from the start, at 0


def count_hint(outcome: str) -> None:
    """One more hint of this outcome (``outbox.breaker``'s ``count``)."""
    HINTS.labels(outcome).inc()


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
        #: operations stopped by a fault of Settled's own configuration, by its reason
        self.config_stops: Counter[str] = Counter()
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
                self._counted = scrape.last_event_id_before(session, since)
            missed_before = list(self._pending)
            last = scrape.last_event_id(session)
            if last > self._counted:
                lo, hi = self._counted, last
                seen = self._count_range(session, lo, hi)
                if seen < hi - lo:
                    for before, after in scrape.gaps_between(session, lo, hi):
                        for missing in range(before + 1, after):
                            self._pending[missing] = now
                self._counted = hi
            if missed_before:
                self._count_ids(session, missed_before)
            self._give_up(now)

    def _count_range(self, session: Session, lo: int, hi: int) -> int:
        seen = 0
        for frm, to, reason, by_reconciler, n in scrape.transitions_between(session, lo, hi):
            self._transition(frm, to, reason, by_reconciler, n)
            seen += n
        for proof, n in scrape.outcomes_between(session, lo, hi):
            self.attempts[proof] += n
        return seen

    def _count_ids(self, session: Session, ids: Iterable[int]) -> None:
        wanted = list(ids)
        for event_id, frm, to, reason, by_reconciler in scrape.transitions_of(session, wanted):
            self._transition(frm, to, reason, by_reconciler, 1)
            del self._pending[event_id]
        for _, proof in scrape.outcomes_of(session, wanted):
            self.attempts[proof] += 1

    def _transition(
        self, frm: str | None, to: str, reason: str | None, by_reconciler: bool, n: int
    ) -> None:
        self.transitions[(frm or "new", to)] += n
        if reason in CONFIG_FAULTS:
            self.config_stops[reason] += n
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


class ClockStepCounter:
    """Steps of the database's clock recorded since this process started, by direction (every
    process that saw one recorded it: ``outbox.clock_steps``)."""

    def __init__(self, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.monotonic = monotonic
        self._born = monotonic()
        #: steps up to this id came before this process
        self._after: int | None = None

    def read(self, session: Session, now: datetime) -> dict[str, int]:
        """The steps recorded since this process started (``now``: database time)."""
        if self._after is None:
            since = now - timedelta(seconds=self.monotonic() - self._born)
            self._after = scrape.last_clock_step_before(session, since)
        return scrape.clock_steps_after(session, self._after)


class LagEpisodeCounter:
    """Episodes of a downstream's clock behind the database's beyond the clock margin, begun
    since this process started (the process that measured one recorded it:
    ``outbox.clock_steps.ClockWatch.downstream_answered``)."""

    def __init__(self, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.monotonic = monotonic
        self._born = monotonic()
        #: rows up to this id came before this process
        self._after: int | None = None

    def read(self, session: Session, now: datetime) -> int:
        """The episodes begun since this process started (``now``: database time)."""
        if self._after is None:
            since = now - timedelta(seconds=self.monotonic() - self._born)
            self._after = scrape.last_lag_before(session, since)
        return scrape.lag_episodes_after(session, self._after)


class SettledCollector(Collector):
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions
        self.counters = EventCounters()
        self.clock_steps = ClockStepCounter()
        self.lag_episodes = LagEpisodeCounter()

    def collect(self) -> Iterator[Metric]:
        with self.sessions() as s:
            live = scrape.live_counts(s)
            self.counters.advance(s, live.now)
            steps = self.clock_steps.read(s, live.now)
            lagging = self.lag_episodes.read(s, live.now)
            replicated = storage_for(s).replication(s)
        yield from self._gauges(live)
        if replicated is not None:
            yield from _replication(replicated)
        yield from self._counters()
        clock = CounterMetricFamily(
            "settled_db_clock_steps",
            "Steps of the database's clock (set, not slewed) seen by any process since this one "
            "started, by direction; after each, a 'not found' is not trusted for a while.",
            labels=["direction"],
        )
        for direction in ("backward", "forward"):
            clock.add_metric([direction], steps.get(direction, 0))
        yield clock
        behind = CounterMetricFamily(
            "settled_downstream_clock_lag_episodes",
            "Episodes of a downstream's clock seen behind the database's beyond the clock "
            "margin, begun since this process started (the log line names the kind); during "
            "each, its deadline fence is trusted only as much later as the lag measured.",
        )
        behind.add_metric([], lagging)
        yield behind

    def _gauges(self, live: scrape.LiveCounts) -> Iterator[Metric]:
        """What is live now: operations by state, the oldest waits, the review queue."""
        now, planned, oldest_due, unresolved = (
            live.now,
            live.planned,
            live.oldest_due,
            live.unresolved,
        )
        depth = live.open_reviews

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
            "settled_send_queue_depth",
            "Planned operations due now, waiting for a worker (not those whose next attempt "
            "is later).",
            value=live.due,
        )
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

    def _counters(self) -> Iterator[Metric]:
        """What happened since this process started: attempts, transitions, reconcile results."""
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
        stops = CounterMetricFamily(
            "settled_configuration_stops",
            "Operations stopped by a fault of Settled's own configuration, not the customer's "
            "nor the downstream's, since this process started: credentials_refused (the "
            "downstream refused the tenant's API key), fingerprint_mismatch (the app's "
            "fingerprint key differs from the worker's).",
            labels=["reason"],
        )
        for fault in sorted(CONFIG_FAULTS):
            stops.add_metric([fault], c.config_stops.get(fault, 0))
        yield stops


def _replication(r: Replication) -> Iterator[Metric]:
    """The primary's standbys by mode, and whether it is replicated asynchronously."""
    standbys = GaugeMetricFamily(
        "settled_replication_standbys",
        "Standbys streaming from the database's primary, by sync_state (unknown: not visible "
        "to Settled's role; grant pg_monitor).",
        labels=["sync_state"],
    )
    modes = Counter(s.sync_state or "unknown" for s in r.standbys)
    for mode in sorted(modes):
        standbys.add_metric([mode], modes[mode])
    yield standbys
    yield GaugeMetricFamily(
        "settled_replication_async",
        "1 when the primary has standbys and no commit waits for one (none synchronous, or "
        "synchronous_commit local or off): a failover can lose whole committed operations.",
        value=1 if r.asynchronous else 0,
    )


def registry(sessions: sessionmaker[Session]) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SettledCollector(sessions))
    return reg
