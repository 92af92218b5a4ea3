"""The app side: intake transactions, in this process or in P producer processes at once, and
a counter of the operations that succeeded."""

from __future__ import annotations

import multiprocessing
import queue
import time
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from bench.phases.common import PARAMS, TENANT, Endpoints, libpq, poll
from outbox import relay
from outbox.db import make_engine
from outbox.intake import CREATED_KEY, Outbox
from outbox.kinds import default_registry
from settled.celery_app import create_app, hint_publisher


class Producer:
    """The backend app: intake in its own transactions, hints published after commit."""

    def __init__(self, endpoints: Endpoints, tag: str = "p") -> None:
        settings = endpoints.settings()
        self.app = create_app(settings)
        self.engine = make_engine(endpoints.db_url, pool_pre_ping=False)
        self.commits = 0  # every COMMIT this engine sends (rollbacks are not xact_commit)
        event.listen(self.engine, "commit", self._count)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.committed_at: dict[int, float] = {}
        # Registered before the relay, so it runs first: the time is taken before publishing.
        event.listen(self.sessions, "after_commit", self._commit_time)
        relay.install(self.sessions, hint_publisher(self.app))
        self.outbox = Outbox.from_settings(settings, default_registry())
        self.tag = tag  # op ids of concurrent producers never collide
        self.serial = 0

    def _count(self, _conn: Any) -> None:
        self.commits += 1

    def _commit_time(self, session: Session) -> None:
        at = time.time()
        for op in session.info.get(CREATED_KEY, ()):
            self.committed_at[op] = at

    def intake(self, count: int, per_txn: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < count:
            with self.sessions.begin() as session:
                for _ in range(min(per_txn, count - len(ids))):
                    self.serial += 1
                    got = self.outbox.enqueue(
                        session, tenant=TENANT, kind="refund", params=PARAMS,
                        op_id=f"op-{self.tag}{self.serial}-{uuid.uuid4().hex[:6]}",
                    )  # fmt: skip
                    ids.append(got.id)
        return ids

    def close(self) -> None:
        self.engine.dispose()
        self.app.close()


class Counter:
    """Polls how many operations succeeded, one autocommit statement (one commit) per poll."""

    def __init__(self, db_url: str) -> None:
        self.conn = psycopg.connect(libpq(db_url), autocommit=True)
        self.commits = 0

    def succeeded(self) -> int:
        self.commits += 1
        row = self.conn.execute(
            "SELECT count(*) FROM operations WHERE state = 'succeeded' AND receipt IS NOT NULL"
        ).fetchone()
        return int(row[0]) if row else 0

    def wait(self, n: int, timeout: float) -> float:
        """Poll until ``n`` operations succeeded; returns the wall-clock time it was seen."""
        poll(lambda: self.succeeded() >= n, timeout, f"{n} operations to succeed", 0.01)
        return time.time()

    def close(self) -> None:
        self.conn.close()


# -- P producer processes --------------------------------------------------------------------


@dataclass
class Intake:
    """What the producer processes committed, one operation per transaction."""

    ids: list[int]
    committed_at: dict[int, float]  # wall clock, taken before the hint is published
    commits: int  # COMMITs the producers sent, their warm-up included
    seconds: float  # from the start signal to the last commit
    late_ms: list[float]  # open loop: how long after its arrival time each transaction began


def _produce(
    endpoints: Endpoints,
    index: int,
    producers: int,
    count: int,
    rate: float | None,
    warm: int,
    ready: Any,
    go: Any,
    start: Any,
    results: Any,
) -> None:
    """One producer process: ``warm`` operations, then (after ``go``) operations ``index``,
    ``index + producers``... of ``count``, one per transaction; as fast as it can, or operation
    k at ``start + k / rate`` (open loop)."""
    producer = Producer(endpoints, tag=f"p{index}-")
    try:
        ready.put(producer.intake(warm, 1))
        go.wait()
        t0 = start.value
        ids: list[int] = []
        late: list[float] = []
        for k in range(index, count, producers):
            if rate is not None:
                due = t0 + k / rate
                wait = due - time.time()
                if wait > 0:
                    time.sleep(wait)
                late.append((time.time() - due) * 1000)
            ids += producer.intake(1, 1)
        committed = {i: producer.committed_at[i] for i in ids}
        results.put((ids, committed, producer.commits, late))
    finally:
        producer.close()


class ProducerProcesses:
    """``producers`` processes committing ``count`` operations, one per intake transaction,
    concurrently; each has its own engine and Celery app, as the processes of a web app do.

    ``start()`` spawns them and returns the ids of their warm-up operations (each warms its
    connections with ``warm`` of its own); ``go()`` lets them commit; ``join()`` collects what
    they committed.
    """

    def __init__(
        self,
        endpoints: Endpoints,
        producers: int,
        count: int,
        *,
        rate: float | None = None,
        warm: int = 2,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._ready = ctx.Queue()
        self._results = ctx.Queue()
        self._go = ctx.Event()
        self._start = ctx.Value("d", 0.0)
        shared = (self._ready, self._go, self._start, self._results)
        self._processes = [
            ctx.Process(
                target=_produce,
                args=(endpoints, i, producers, count, rate, warm, *shared),
                name=f"producer-{i}",
                daemon=True,
            )
            for i in range(producers)
        ]
        self._rate = rate
        self._began = 0.0

    def _get(self, q: Any, timeout: float, what: str) -> Any:
        end = time.monotonic() + timeout
        while True:
            try:
                return q.get(timeout=0.5)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in self._processes):
                    raise RuntimeError(f"a producer process failed before {what}") from None
                if time.monotonic() > end:
                    raise TimeoutError(f"timed out waiting for {what}") from None

    def start(self, timeout: float = 120.0) -> list[int]:
        for p in self._processes:
            p.start()
        warm: list[int] = []
        for _ in self._processes:
            warm += self._get(self._ready, timeout, "the producers' warm-up")
        return warm

    def go(self) -> None:
        # The open loop's time zero a little ahead, so that every process sees it in time.
        self._began = time.time() + (0.05 if self._rate is not None else 0.0)
        self._start.value = self._began
        self._go.set()

    def join(self, timeout: float = 600.0) -> Intake:
        intake = Intake([], {}, 0, 0.0, [])
        for _ in self._processes:
            ids, committed, commits, late = self._get(self._results, timeout, "the producers")
            intake.ids += ids
            intake.committed_at.update(committed)
            intake.commits += commits
            intake.late_ms += late
        for p in self._processes:
            p.join(30)
        intake.seconds = max(intake.committed_at.values(), default=self._began) - self._began
        return intake

    def close(self) -> None:
        for p in self._processes:
            if p.is_alive():
                p.kill()
                p.join(10)
