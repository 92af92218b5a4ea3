"""The reconciler (on celery beat; ``settled reconcile --once`` for operators).

Each pass leases a bounded batch of ``unknown`` operations due for a look, and ``submitted``
ones whose worker died, with the same lease rules as workers; asks the downstream (it only
queries, never sends); and writes what the pure ``decide`` function concluded.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from outbox import store
from outbox.db import db_now
from outbox.errors import StaleLease
from outbox.kinds import KindRegistry
from outbox.states import State
from reconciler.decide import Decision, Situation, decide
from workers.gateway import Gateway, LookupOutcome, look_up

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


@dataclass
class Reconciler:
    sessions: sessionmaker[Session]
    gateway: Gateway
    registry: KindRegistry
    worker: str
    lease_seconds: float = 60.0
    client_timeout: float = 10.0
    review_after: float = 600.0
    batch: int = 100
    totals: Counter[str] = field(default_factory=Counter)

    @property
    def actor(self) -> str:
        """Lease owner and event actor: marks every write as the reconciler's."""
        return f"reconciler:{self.worker}"

    def run_once(self) -> PassReport:
        """One pass over at most ``batch`` operations."""
        with self.sessions.begin() as session:
            claims = store.claim_unresolved(
                session, worker=self.actor, lease_seconds=self.lease_seconds, limit=self.batch
            )
        outcomes: Counter[str] = Counter()
        for claimed in claims:
            try:
                outcomes[self._reconcile(claimed)] += 1
            except StaleLease:
                outcomes["stale"] += 1
        with self.sessions() as session:
            oldest = store.oldest_unknown_since(session)
            now = store.db_time(session)
        self.totals.update(outcomes)
        report = PassReport(
            len(claims),
            dict(outcomes),
            (now - oldest).total_seconds() if oldest else None,
            now,
        )
        if claims:
            log.info("reconcile pass", extra=report.as_dict())
        return report

    def _reconcile(self, claimed: store.Claimed) -> str:
        kind = self.registry.get(claimed.kind)
        lookup: LookupOutcome | None = None
        if kind.contract.queryable:
            lookup = look_up(self.gateway, claimed, kind, seconds=min(self.client_timeout, 30.0))
        with self.sessions.begin() as session:
            facts = store.facts(session, claimed.id)
            now = store.db_time(session)
            situation = Situation(
                state=claimed.state,
                contract=kind.contract,
                now=now,
                deadline=claimed.deadline,
                first_sent_at=claimed.first_sent_at,
                last_sent_at=facts.last_sent_at,
                unknown_since=facts.unknown_since,
                lookups=facts.lookups,
                client_timeout=timedelta(seconds=self.client_timeout),
                review_after=timedelta(seconds=self.review_after),
                in_review=facts.in_review,
            )
            decision = decide(situation, lookup)
            self._write(session, claimed, decision, looked=lookup is not None, before=facts.lookups)
        return decision.outcome

    def _write(
        self, session: Session, claimed: store.Claimed, d: Decision, *, looked: bool, before: int
    ) -> None:
        evidence = dict(d.evidence)
        if d.review is not None:
            evidence["attempts"] = store.attempt_history(session, claimed.id)
            evidence["lookups"] = before + int(looked)
        if d.event is None or d.to is None:
            assert d.recheck_at is not None
            store.touch(
                session,
                claimed,
                actor=self.actor,
                note=d.outcome,
                recheck_at=d.recheck_at,
                looked=looked,
                evidence=evidence,
                review=d.review,
            )
            return
        values: dict[str, Any] = {}
        if d.recheck_at is not None or d.to is State.PLANNED:
            values["next_attempt_at"] = d.recheck_at or db_now()
        store.move(
            session,
            claimed,
            d.event,
            d.to,
            actor=self.actor,
            reason=d.reason,
            evidence=evidence,
            values=values,
            review=d.review,
            receipt=d.receipt,
            looked=looked,
        )
        if d.to.terminal:
            store.close_reviews(
                session,
                claimed.id,
                by=self.actor,
                resolution={"state": d.to.value, "by": "reconciler", **d.evidence},
            )
