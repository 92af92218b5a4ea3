"""Prometheus metrics, read from the database at scrape time.

The database is the only truth, and every process (web, worker) serves the same figures
without multiprocess bookkeeping: operations by state, attempts by outcome, the age of the
oldest unknown operation, the review queue depth and the reconciler's results.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from outbox import store
from outbox.models import Attempt, Operation, OperationEvent, ReviewItem
from outbox.states import State


class SettledCollector(Collector):
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[Metric]:
        with self.sessions() as s:
            states = GaugeMetricFamily(
                "settled_operations", "Operations by state.", labels=["state"]
            )
            counts = dict(
                s.execute(select(Operation.state, func.count()).group_by(Operation.state)).all()
            )
            for state in State:
                states.add_metric([state.value], counts.get(state.value, 0))
            yield states

            attempts = CounterMetricFamily(
                "settled_attempts", "Attempts by what their outcome proved.", labels=["outcome"]
            )
            for proof, n in s.execute(
                select(Attempt.proof, func.count()).group_by(Attempt.proof)
            ).all():
                attempts.add_metric([proof or "in_flight"], n)
            yield attempts

            oldest = store.oldest_unknown_since(s)
            age = (store.db_time(s) - oldest).total_seconds() if oldest else 0.0
            yield GaugeMetricFamily(
                "settled_oldest_unknown_age_seconds",
                "Age of the oldest operation in state unknown (0 when none).",
                value=age,
            )
            depth = s.scalar(
                select(func.count()).select_from(ReviewItem).where(ReviewItem.resolved_at.is_(None))
            )
            yield GaugeMetricFamily(
                "settled_review_queue_depth", "Open review items.", value=depth or 0
            )

            results = CounterMetricFamily(
                "settled_reconcile_results",
                "What reconciler passes concluded, per operation looked at.",
                labels=["result"],
            )
            rows = s.execute(
                select(
                    OperationEvent.from_state,
                    OperationEvent.to_state,
                    OperationEvent.reason,
                    func.count(),
                )
                .where(OperationEvent.actor.like("reconciler:%"))
                .group_by(OperationEvent.from_state, OperationEvent.to_state, OperationEvent.reason)
            ).all()
            merged: dict[str, int] = {}
            for frm, to, reason, n in rows:
                result = (reason or "looked") if frm == to else f"to_{to}"
                merged[result] = merged.get(result, 0) + n
            for result, n in sorted(merged.items()):
                results.add_metric([result], n)
            yield results


def registry(sessions: sessionmaker[Session]) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SettledCollector(sessions))
    return reg
