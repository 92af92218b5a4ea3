"""The reconciler (on celery beat; ``settled reconcile --once`` for operators).

Each pass leases a bounded batch of ``unknown`` operations due for a look, and ``submitted``
ones whose worker died, with the same lease rules as workers; asks the downstream (it only
queries, never sends); and writes what the pure ``decide`` function concluded.

A pass claims a few operations at a time, as many as its lookups can answer while their
leases are renewed (``outbox.leases``). The chunk's lookups run one after another, each with
its own time counted from when it starts (never from the claim: a slow first answer must not
eat the others' time), and never past the lease as renewed. A lookup the lease leaves no time
for (the process stalled, the lease could not be kept) is not asked: it is no evidence, not
even of an unavailable downstream, so nothing is decided, counted or put in review; the
operation is due again at once. A "not found" is dated by the database time read before the
question was asked (the claim's), never by when the answer came back, and proves nothing for
a while after a step of the database's clock (each reading a pass takes is watched:
``outbox.clock_steps``). One operation that cannot be reconciled (a value the database
refuses, a bug) is logged, put in review if it can be, and the pass goes on with the others.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy.orm import Session, sessionmaker

from outbox.change import Change
from outbox.clock import DbClock, Monotonic, Step
from outbox.clock_steps import ClockWatch
from outbox.downstream import (
    Gateway,
    LookupOutcome,
    look_up,
    lookup_deadline,
)
from outbox.errors import StaleLease
from outbox.kinds import Kind, KindRegistry
from outbox.leases import LONGEST_IN_LEASES, LeaseKeeper
from outbox.observer import NO_OBSERVER, Observer, guarded
from outbox.outage import DatabaseOutage
from outbox.port_shim import as_gateway
from outbox.states import Event, State
from outbox.storage import Storage, storage_for
from outbox.storage.attempts import attempt_history, operation_facts
from outbox.storage.claims import Claimed, claim_unresolved
from outbox.storage.operations import db_time, oldest_unknown_since
from outbox.storage.transitions import Transition
from outbox.verdict_due import LONGEST_LOOKUP, MAX_RECHECK
from reconciler.decide import Situation, decide, situation_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassReport:
    """What one pass did: counts per outcome, and the age of the oldest unknown operation."""

    claimed: int
    outcomes: dict[str, int]
    oldest_unknown_seconds: float | None
    at: datetime

    def as_dict(self) -> dict[str, Any]:
        return {
            "claimed": self.claimed,
            "outcomes": dict(sorted(self.outcomes.items())),
            "oldest_unknown_seconds": self.oldest_unknown_seconds,
            "at": self.at.isoformat(),
        }


class Resender(Protocol):
    """Who sends an unknown operation again with its key, under the reconciler's claim: the
    executor, the one retry owner (``workers.executor.Executor.resend``)."""

    def resend(
        self, claimed: Claimed, kind: Kind, clock: DbClock, *, looked: bool
    ) -> State | None: ...


@dataclass
class Reconciler:
    sessions: sessionmaker[Session]
    gateway: Gateway
    registry: KindRegistry
    worker: str
    lease_seconds: float = 15.0
    client_timeout: float = 10.0
    review_after: float = 600.0
    batch: int = 100
    totals: Counter[str] = field(default_factory=Counter)
    monotonic: Monotonic = time.monotonic
    #: this process's watch on the database's clock (shared with its other services)
    clock_watch: ClockWatch = field(default_factory=ClockWatch)
    #: told of each operation reconciled (``outbox.observer``; its errors are logged, never
    #: change what is decided or written)
    observer: Observer = NO_OBSERVER
    #: sends again, with the same key, what a "not found" cannot settle yet (None: this
    #: reconciler only looks, and waits for quiescence)
    resender: Resender | None = None
    #: this process's view of a database outage (shared with its other services): one line
    #: when it starts and one when it ends, never one per operation
    outage: DatabaseOutage = field(default_factory=DatabaseOutage)

    _keeper: LeaseKeeper | None = field(default=None, init=False, repr=False)
    _storage: Storage | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.gateway = as_gateway(self.gateway, stacklevel=3)  # an old-style adapter too

    @property
    def storage(self) -> Storage:
        """The database's Storage (the sessions' engine's)."""
        if self._storage is None or self._storage.engine is not self.sessions.kw["bind"]:
            self._storage = storage_for(self.sessions)
        return self._storage

    @property
    def keeper(self) -> LeaseKeeper:
        if self._keeper is None:
            self._keeper = LeaseKeeper(
                self.sessions,
                owner=self.actor,
                lease_seconds=self.lease_seconds,
                monotonic=self.monotonic,
                outage=self.outage,
            )
        return self._keeper

    def close(self) -> None:
        if self._keeper is not None:
            self._keeper.close()

    @property
    def actor(self) -> str:
        """Lease owner and event actor: marks every write as the reconciler's."""
        return f"reconciler:{self.worker}"

    @property
    def lookup_seconds(self) -> float:
        """Longest one lookup may take, from its own start."""
        return min(self.client_timeout, LONGEST_LOOKUP.total_seconds())

    @property
    def lookup_least(self) -> float:
        """Least time a lookup must have left on its lease to be asked: its whole time, or
        half a lease where that is shorter (a lease renewed every third always has it)."""
        return min(self.lookup_seconds, self.lease_seconds / 2)

    @property
    def chunk(self) -> int:
        """Operations claimed at once: their lookups, one after another, fit in the time their
        leases are renewed for (``outbox.leases``), twice over."""
        held_for = LONGEST_IN_LEASES * self.lease_seconds
        each = self.lookup_seconds + (self.client_timeout if self.resender is not None else 0.0)
        return max(1, min(self.batch, int(held_for // (2 * each))))

    def run_once(self) -> PassReport:
        """One pass over at most ``batch`` operations."""
        outcomes: Counter[str] = Counter()
        claimed_total = 0
        while claimed_total < self.batch:
            mono = self.monotonic()
            limit = min(self.chunk, self.batch - claimed_total)
            with self.sessions.begin() as session:
                claims = claim_unresolved(
                    session, worker=self.actor, lease_seconds=self.lease_seconds, limit=limit
                )
            if claims:
                self._clock_read(claims[0].now, mono)
            claimed_total += len(claims)
            with self.keeper.holding(claims):  # renewed while the chunk is worked through
                for claimed in claims:
                    clock = DbClock(claimed.now, mono, self.monotonic)
                    outcomes[self._reconcile_safely(claimed, clock)] += 1
            if len(claims) < limit:
                break  # nothing more was due
        with self.sessions() as session:
            oldest = oldest_unknown_since(session)
            before = self.monotonic()
            now = db_time(session)
        self._clock_read(now, before)
        self.totals.update(outcomes)
        report = PassReport(
            claimed_total,
            dict(outcomes),
            (now - oldest).total_seconds() if oldest else None,
            now,
        )
        if claimed_total:
            log.info("reconcile pass", extra=report.as_dict())
        return report

    def _downstream_lag(self, session: Session, kind: Kind, now: datetime) -> timedelta | None:
        """How far ``kind``'s downstream's clock was seen behind the database's, at worst and
        recently (this lookup's answer, this process's and every recorded measurement)."""
        lag = self.clock_watch.downstream_lag(session, kind.name, now)
        return None if lag is None else timedelta(seconds=lag)

    def _clock_read(
        self,
        db_at: datetime,
        before: float,
        session: Session | None = None,
        kept: list[Step] | None = None,
    ) -> None:
        """A reading of the database's clock taken from ``before``: a step it shows is logged
        and recorded (in ``session``, and kept in ``kept`` in case that transaction is rolled
        back: ``_steps_kept``; else in a transaction of its own)."""
        step = self.clock_watch.seen(db_at, before, self.monotonic(), by=self.actor)
        if step is None:
            return
        if session is not None:
            self.clock_watch.record(session, step, by=self.actor)
            if kept is not None:
                kept.append(step)
        else:
            self.clock_watch.record_now(self.sessions, step, by=self.actor)

    @contextmanager
    def _steps_kept(self) -> Iterator[list[Step]]:
        """The steps recorded in a transaction the block opens: if it is rolled back (a write
        refused as stale, an error), each is recorded again in a transaction of its own. The
        detector has taken in the reading that showed it and will not show it again, and the
        other processes learn of a step only from its record."""
        kept: list[Step] = []
        try:
            yield kept
        except BaseException:
            for step in kept:
                self.clock_watch.record_now(self.sessions, step, by=self.actor)
            raise

    def _reconcile_safely(self, claimed: Claimed, clock: DbClock) -> str:
        """``_reconcile_caught``, inside the observer's ``reconciling``."""
        with guarded(self.observer).reconciling(claimed) as seen:
            outcome = self._reconcile_caught(claimed, clock)
            seen(outcome)
            return outcome

    def _reconcile_caught(self, claimed: Claimed, clock: DbClock) -> str:
        """``_reconcile``, and whatever goes wrong stays with this operation."""
        try:
            return self._reconcile(claimed, clock)
        except StaleLease:
            return "stale"
        except Exception as exc:
            if self.outage.away(exc, skipped=1):
                # A restart or a network blip is nobody's case to review: the lease lapses
                # and a later pass looks again (the operation is as it was).
                return "deferred"
            log.exception("reconcile failed for an operation", extra={"operation_id": claimed.id})
            self._to_review(claimed, type(exc).__name__)
            return "error"

    def _to_review(self, claimed: Claimed, error: str) -> None:
        """Record the failure and put the operation in review, to be looked at again later;
        if even that fails, the lease expires and a later pass tries again. A ``submitted``
        operation keeps its lease, which expires (a released one would never be looked at)."""
        if claimed.state is not State.UNKNOWN:
            return
        try:
            failed = Transition.of(
                claimed,
                Change.look(
                    "reconcile_failed",
                    recheck_at=claimed.now + MAX_RECHECK,
                    evidence={"error": error},
                    review="reconcile_failed",
                ),
            )
            with self.sessions.begin() as session:
                self.storage.write_transition(session, failed, actor=self.actor)
        except Exception:
            log.exception("could not record the failure", extra={"operation_id": claimed.id})

    def _reconcile(self, claimed: Claimed, clock: DbClock) -> str:
        kind = self.registry.get(claimed.kind)
        lookup: LookupOutcome | None = None
        if kind.contract.queryable:
            lease = self.keeper.lease_until(claimed)  # as renewed while the chunk is worked
            deadline = lookup_deadline(clock, lease, self.lookup_seconds, least=self.lookup_least)
            if deadline is None:
                return self._not_asked(claimed)
            lookup = look_up(self.gateway, claimed, kind, deadline=deadline)
        with self._steps_kept() as kept, self.sessions.begin() as session:
            facts = operation_facts(session, claimed.id)
            before = self.monotonic()
            now = db_time(session)
            self._clock_read(now, before, session, kept)
            situation = situation_of(
                state=claimed.state,
                contract=kind.contract,
                deadline=claimed.deadline,
                first_sent_at=claimed.first_sent_at,
                claimed_at=claimed.now,  # read before the lookup was asked
                facts=facts,
                now=now,
                client_timeout=self.client_timeout,
                review_after=self.review_after,
                clock_doubt_until=self.clock_watch.doubt_until(session),
                resend=self.resender is not None,
                downstream_lag=self._downstream_lag(session, kind, now),
                clock_margin=timedelta(seconds=self.clock_watch.downstreams.margin),
            )
            decision = decide(situation, lookup)
            if decision.event is not Event.RESEND:
                self._write(
                    session, claimed, decision, looked=lookup is not None, before=facts.lookups
                )
        if decision.event is Event.RESEND:
            return self._resend(claimed, kind, clock, situation, lookup, facts.lookups)
        assert decision.code is not None
        return decision.code

    def _resend(
        self,
        claimed: Claimed,
        kind: Kind,
        clock: DbClock,
        situation: Situation,
        lookup: LookupOutcome | None,
        lookups: int,
    ) -> str:
        """Hand the operation to the executor to send again with its key, bounded by this
        claim's lease as renewed; where the executor's checks forbid it (a cancel asked for,
        the deadline or the key retention passed, the budget spent), decide as a reconciler
        that cannot resend (it waits for its proof)."""
        assert self.resender is not None
        lease = self.keeper.lease_until(claimed)
        if lease is not None and self.resender.resend(
            replace(claimed, lease_until=lease), kind, clock, looked=lookup is not None
        ):
            return "resent"
        with self.sessions.begin() as session:
            decision = decide(replace(situation, resend=False), lookup)
            self._write(session, claimed, decision, looked=lookup is not None, before=lookups)
        assert decision.code is not None
        return decision.code

    def _not_asked(self, claimed: Claimed) -> str:
        """The lease left no time to ask about ``claimed``: nothing is decided, recorded as a
        lookup, counted or put in review. An unknown operation is released, due again at once,
        with an event saying it was not asked; a submitted one is left under the lease it has,
        which lapses (released, it would never be looked at)."""
        log.warning(
            "lookup not asked: the lease left no time for it",
            extra={"operation_id": claimed.id},
        )
        if claimed.state is State.UNKNOWN:
            evidence = {"asked": False, "why": "the lease left no time for the lookup"}
            again = Transition.look(
                claimed, note="not_asked", recheck_at=claimed.now, looked=False, evidence=evidence
            )
            with self.sessions.begin() as session:
                self.storage.write_transition(session, again, actor=self.actor)
        return "not_asked"

    def _write(
        self, session: Session, claimed: Claimed, change: Change, *, looked: bool, before: int
    ) -> None:
        if change.review is not None:
            history = {"attempts": attempt_history(session, claimed.id), "lookups": before + looked}
            change = replace(change, evidence={**change.evidence, **history})
        concluded = Transition.of(claimed, change, looked=looked)
        self.storage.write_transition(session, concluded, actor=self.actor)
