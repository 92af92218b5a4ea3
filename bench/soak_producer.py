"""A producer process of the fault soak: an app that enqueues operations through the public API.

Each intake transaction writes the app's own business row (``soak_requests``) and the
operation intent together (``Outbox.enqueue`` in the caller's transaction), and the relay
publishes the hints after the commit. A transaction that fails on a lost or refused database
connection (PostgreSQL restarting) is run again with the same op_ids, as an app retrying a
request would: a commit that did happen is then a replay (the same operation, nothing new).
"""

from __future__ import annotations

import functools
import heapq
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pydantic import SecretStr  # noqa: E402
from sqlalchemy import select, text  # noqa: E402
from sqlalchemy.exc import DBAPIError  # noqa: E402
from sqlalchemy.orm import Session, sessionmaker  # noqa: E402

from bench.soak_plan import BIG_ORDERS, Job, producer_jobs, refund_params  # noqa: E402
from outbox import relay, runs  # noqa: E402
from outbox.db import make_engine  # noqa: E402
from outbox.errors import InvalidInput  # noqa: E402
from outbox.intake import Enqueued, Outbox  # noqa: E402
from outbox.models import Operation, Run  # noqa: E402
from outbox.settings import Settings  # noqa: E402
from settled.celery_app import create_app, hint_publisher  # noqa: E402

T = TypeVar("T")

BUSINESS_TABLE = """
CREATE TABLE soak_requests (
    tenant text NOT NULL,
    op_id text NOT NULL,
    kind text NOT NULL,
    producer integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (tenant, op_id)
)
"""
_BUSINESS_ROW = text(
    "INSERT INTO soak_requests (tenant, op_id, kind, producer) "
    "VALUES (:tenant, :op_id, :kind, :producer) ON CONFLICT DO NOTHING"
)
#: A transaction that cannot commit for this long ends the producer (reported as a failure).
GIVE_UP_SECONDS = 120.0


@dataclass(frozen=True)
class ProducerConfig:
    index: int
    seed: int
    quota: int
    rate: float  # operations per second this producer aims at
    database_url: str
    broker_url: str
    fingerprint_key: str
    idempotency_secret: str
    result_path: str


class Producer:
    def __init__(self, cfg: ProducerConfig, progress: Any) -> None:
        self.cfg = cfg
        self.progress = progress
        settings = Settings(
            database_url=cfg.database_url,
            broker_url=cfg.broker_url,
            fingerprint_keys={"v1": SecretStr(cfg.fingerprint_key)},
            idempotency_secret=SecretStr(cfg.idempotency_secret),
        )
        self.engine = make_engine(cfg.database_url, pool_size=2, max_overflow=0)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.celery = create_app(settings)
        relay.install(self.sessions, hint_publisher(self.celery))
        self.outbox = Outbox.from_settings(settings)
        self.committed: list[tuple[str, str, str]] = []  # (tenant, op_id, kind)
        self.counts = {
            "transactions": 0,
            "retries": 0,
            "single": 0,
            "batch": 0,
            "after_sales": 0,
            "cancels": 0,
            "compensations": 0,
            "fallback_refunds": 0,
        }
        self.first_commit: float | None = None
        self.last_commit: float | None = None

    def op_id(self, n: int) -> str:
        return f"soak-{self.cfg.seed}-p{self.cfg.index}-{n}"

    def rng(self, n: int) -> random.Random:
        """The randomness of operation ``n``: the same whatever the timing of the run."""
        return random.Random(f"params\x00{self.cfg.seed}\x00{self.cfg.index}\x00{n}")

    # -- transactions ---------------------------------------------------------------------

    def transact(self, work: Callable[[Session], T]) -> T:
        """Run ``work`` in one transaction, again (same op_ids) while the database is away."""
        delay = 0.1
        give_up = time.monotonic() + GIVE_UP_SECONDS
        while True:
            try:
                with self.sessions.begin() as session:
                    result = work(session)
                break
            except DBAPIError as exc:
                if not _connection_problem(exc) or time.monotonic() > give_up:
                    raise
                self.counts["retries"] += 1
                time.sleep(delay)
                delay = min(1.0, delay * 2)
        now = time.monotonic()
        self.counts["transactions"] += 1
        self.first_commit = self.first_commit or now
        self.last_commit = now
        return result

    def enqueue(
        self, s: Session, tenant: str, n: int, kind: str, params: dict[str, Any], **kw: Any
    ) -> Enqueued:
        op_id = self.op_id(n)
        s.execute(
            _BUSINESS_ROW,
            {"tenant": tenant, "op_id": op_id, "kind": kind, "producer": self.cfg.index},
        )
        return self.outbox.enqueue(s, tenant=tenant, op_id=op_id, kind=kind, params=params, **kw)

    def done(self, tenant: str, ns: list[int], kinds: list[str]) -> None:
        self.committed += [(tenant, self.op_id(n), k) for n, k in zip(ns, kinds, strict=True)]
        with self.progress.get_lock():
            self.progress.value += len(ns)

    # -- jobs -----------------------------------------------------------------------------

    def refunds(self, job: Job) -> None:
        ns = list(range(job.first, job.first + job.size))
        params = [refund_params(self.rng(n), job.tenant) for n in ns]

        def work(s: Session) -> None:
            for n, p in zip(ns, params, strict=True):
                self.enqueue(s, job.tenant, n, "refund", p)

        self.transact(work)
        self.counts[job.kind] += 1
        self.done(job.tenant, ns, ["refund"] * len(ns))

    def ticket(self, job: Job) -> str:
        """Open the run and enqueue the ticket; returns the run's handle."""
        n = job.first
        rng = self.rng(n)
        ticket = {
            "ticket_id": f"T{self.cfg.seed}p{self.cfg.index}n{n}",
            "order_id": f"O-{rng.randrange(BIG_ORDERS)}",
            "reason": rng.choice(["damaged", "wrong_item", "not_as_described", "other"]),
        }

        def work(s: Session) -> str:
            # After a commit whose outcome was lost, the ticket exists: keep its run.
            existing = s.scalar(
                select(Run.handle)
                .join(Operation, Operation.run_id == Run.id)
                .where(Operation.tenant == job.tenant, Operation.op_id == self.op_id(n))
            )
            if existing is not None:
                return existing
            run = runs.open_run(s, tenant=job.tenant, title=f"return {ticket['ticket_id']}")
            self.enqueue(s, job.tenant, n, "after_sales_ticket", ticket, run=run)
            return run.handle

        handle = self.transact(work)
        self.counts["after_sales"] += 1
        self.done(job.tenant, [n], ["after_sales_ticket"])
        return handle

    def pickup(self, job: Job, handle: str) -> None:
        n = job.first + 1
        params = {
            "ticket_id": f"T{self.cfg.seed}p{self.cfg.index}n{job.first}",
            "day": "2026-03-02",
            "slot": self.rng(n).choice(["morning", "afternoon", "evening"]),
        }

        def work(s: Session) -> None:
            run = runs.find_run(s, job.tenant, handle)
            self.enqueue(s, job.tenant, n, "pickup", params, run=run)

        self.transact(work)
        self.done(job.tenant, [n], ["pickup"])

    def cancel(self, job: Job, handle: str) -> None:
        self.transact(lambda s: runs.cancel_run(s, job.tenant, handle, actor="soak-producer"))
        self.counts["cancels"] += 1

    def compensate(self, job: Job) -> None:
        n = job.first + 2
        fallback = refund_params(self.rng(n), job.tenant)
        params = {
            "ticket_id": f"T{self.cfg.seed}p{self.cfg.index}n{job.first}",
            "reason": "customer_request",
        }

        def work(s: Session) -> str:
            mine = s.scalar(
                select(Operation.kind).where(
                    Operation.tenant == job.tenant, Operation.op_id == self.op_id(n)
                )
            )
            if mine is not None:  # committed before, its outcome lost: nothing more to do
                return mine
            original = s.scalar(
                select(Operation).where(
                    Operation.tenant == job.tenant, Operation.op_id == self.op_id(job.first)
                )
            )
            assert original is not None
            try:
                with s.begin_nested():
                    runs.compensate(
                        self.outbox,
                        s,
                        original,
                        op_id=self.op_id(n),
                        kind="ticket_cancel",
                        params=params,
                    )
                    s.execute(
                        _BUSINESS_ROW,
                        {
                            "tenant": job.tenant,
                            "op_id": self.op_id(n),
                            "kind": "ticket_cancel",
                            "producer": self.cfg.index,
                        },
                    )
                return "ticket_cancel"
            except InvalidInput:  # nothing to compensate, or the run was cancelled
                self.enqueue(s, job.tenant, n, "refund", fallback)
                return "refund"

        kind = self.transact(work)
        self.counts["compensations" if kind == "ticket_cancel" else "fallback_refunds"] += 1
        self.done(job.tenant, [n], [kind])

    # -- the loop -------------------------------------------------------------------------

    def run(self, start: float) -> None:
        """Enqueue the jobs, paced from ``start`` (``time.monotonic()``, a clock all processes
        share) at ``rate`` operations per second."""
        cfg = self.cfg
        jobs = producer_jobs(cfg.seed, cfg.index, cfg.quota)
        later: list[tuple[float, int, Callable[[], None]]] = []  # (due, seq, action)
        seq = 0
        for job in jobs:
            due = start + job.first / cfg.rate
            while later and later[0][0] <= due:
                self._at(later[0][0])
                heapq.heappop(later)[2]()
            self._at(due)
            if job.kind != "after_sales":
                self.refunds(job)
                continue
            handle = self.ticket(job)
            steps: list[tuple[float, Callable[[], None]]] = [
                (job.pickup_after, functools.partial(self.pickup, job, handle))
            ]
            if job.cancel_after is not None:
                steps.append((job.cancel_after, functools.partial(self.cancel, job, handle)))
            if job.compensate_after is not None:
                steps.append((job.compensate_after, functools.partial(self.compensate, job)))
            for after, step in steps:
                seq += 1
                heapq.heappush(later, (due + after, seq, step))
        while later:
            self._at(later[0][0])
            heapq.heappop(later)[2]()

    @staticmethod
    def _at(due: float) -> None:
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)  # pacing: the producer's own schedule

    def result(self, error: str | None) -> dict[str, Any]:
        return {
            "index": self.cfg.index,
            "committed": self.committed,
            "counts": self.counts,
            "first_commit": self.first_commit,
            "last_commit": self.last_commit,
            "error": error,
        }

    def close(self) -> None:
        self.celery.close()
        self.engine.dispose()


def _connection_problem(exc: DBAPIError) -> bool:
    """The database went away or refused the connection (restarting, recovering)."""
    import psycopg

    return exc.connection_invalidated or isinstance(
        exc.orig, psycopg.OperationalError | psycopg.InterfaceError
    )


def main(cfg: ProducerConfig, progress: Any, ready: Any, go: Any, start: Any) -> None:
    """Entry point of the producer process (``multiprocessing``, spawn context): say ``ready``
    once built, wait for ``go``, then produce from the time in ``start``."""
    logging.basicConfig(level=logging.ERROR)  # the relay's "hint not published" stays quiet
    producer = Producer(cfg, progress)
    error = None
    try:
        ready.put(cfg.index)
        if not go.wait(300):
            raise TimeoutError("the soak never said go")
        producer.run(start.value)
    except Exception as exc:  # reported in the result, the soak fails on it
        error = f"{type(exc).__name__}: {str(exc)[:500]}"
    finally:
        Path(cfg.result_path).write_text(json.dumps(producer.result(error)))
        producer.close()
