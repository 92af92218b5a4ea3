"""The whole pipeline on this machine: intake → Celery prefork workers → simulator → receipt.

Run from the repository root (PostgreSQL and Redis must answer; nothing else is needed)::

    python bench/pipeline.py --ops 3000 --concurrency 4

One run creates a throwaway PostgreSQL database (dropped at the end), flushes a dedicated Redis
db index, starts the simulator (``settled simulator``, in-memory ledger) and measures, on the same
services:

* the simulator alone (C processes submitting refunds over HTTP);
* the no-op drain: ``bench.noop`` tasks through the product's Celery configuration
  (``bench/noop_app.py``: acks_late, prefetch 1, JSON, the same worker flags);
* end-to-end operations per second: hints are queued while the workers' consumers are paused,
  then the clock runs from resuming them to the last ``succeeded`` commit and the last hint
  consumed (same method as the no-op drain, so the two rates compare); the worker runs with
  beat, as in production, so the sweeper re-hints any operation retried after a not-sent
  outcome. The backlog is taken 100 operations per intake transaction, so each hint message
  carries 20 operation ids (the relay's default);
* the same with one operation per intake transaction (one hint message per operation), on a
  fresh worker, as a reference: what an app that commits its operations one by one gets;
* commit-to-receipt latency p50/p99 with an open-loop producer at half the maximum rate, on a
  fresh worker: operation k arrives at k / rate and one intake transaction commits every
  operation that has arrived (one per transaction while the producer keeps up; the table
  prints the mean); measured from the intake's commit to the commit that wrote the receipt,
  seen through a NOTIFY trigger the bench installs in its throwaway database for this phase
  only (a notification is delivered at commit, so no polling), by a listener process of its
  own (so it never shares the producer's GIL);
* worker-side commits per operation, over the max-rate phase: ``xact_commit`` of the database
  in ``pg_stat_database``, read before its worker starts and after every backend of the
  database has exited (exiting backends flush their counters), minus the commits the benchmark
  itself made (intake transactions and completion polls, counted exactly);
* a raw-SQL lifecycle with psycopg (insert, fenced claim, fenced outcome: three commits) from C
  threads, in the same database after the counters were read.

It prints a table with the targets of issue 4 beside the figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import redis
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session, sessionmaker

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # ``python bench/pipeline.py`` from anywhere
    sys.path.insert(0, str(ROOT))

from outbox import relay  # noqa: E402
from outbox.db import make_engine, upgrade  # noqa: E402
from outbox.intake import CREATED_KEY, Outbox  # noqa: E402
from outbox.kinds import default_registry  # noqa: E402
from outbox.models import Operation  # noqa: E402
from outbox.settings import Settings  # noqa: E402
from settled.celery_app import QUEUE, create_app, hint_publisher  # noqa: E402

TENANT = "acme"
API_KEY = "sk_test_bench_0c5e7a91"  # a throwaway key of the throwaway simulator
FINGERPRINT_KEY = "bench-fingerprint-key-0001"
IDEMPOTENCY_SECRET = "bench-idempotency-secret"
ORDER = "B-1"
PARAMS = {"order_id": ORDER, "amount_minor": 1, "currency": "CNY", "payee": "P-1"}
CHANNEL = "settled_bench"
NOOP = "bench.noop"

NOTIFY_TRIGGER = f"""
CREATE FUNCTION bench_notify_succeeded() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{CHANNEL}', NEW.id::text);
    RETURN NULL;
END $$;
CREATE TRIGGER bench_succeeded AFTER UPDATE OF state ON operations FOR EACH ROW
    WHEN (NEW.state = 'succeeded' AND OLD.state <> 'succeeded')
    EXECUTE FUNCTION bench_notify_succeeded();
"""

RAW_TABLE = """
CREATE TABLE bench_raw (
    id bigserial PRIMARY KEY,
    state text NOT NULL DEFAULT 'planned',
    lease_owner text,
    lease_until timestamptz,
    lease_version integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    params jsonb NOT NULL,
    receipt jsonb
);
CREATE INDEX bench_raw_due ON bench_raw (next_attempt_at) WHERE state = 'planned';
"""


# -- small helpers ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def poll(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.01) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(interval)


def libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class Services:
    admin_url: str  # libpq URL of the maintenance database
    db_name: str
    db_url: str  # SQLAlchemy URL of the throwaway database
    broker_url: str
    sim_url: str
    workdir: Path
    concurrency: int
    claim_batch: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
        env.update(
            SETTLED_DATABASE_URL=self.db_url,
            SETTLED_BROKER_URL=self.broker_url,
            SETTLED_DOWNSTREAM_URL=self.sim_url,
            SETTLED_DOWNSTREAM_API_KEYS=json.dumps({TENANT: API_KEY}),
            SETTLED_DOWNSTREAM_TIMEOUT="5.0",
            SETTLED_FINGERPRINT_KEYS=json.dumps({"v1": FINGERPRINT_KEY}),
            SETTLED_IDEMPOTENCY_SECRET=IDEMPOTENCY_SECRET,
            SETTLED_LEASE_SECONDS="30",
            SETTLED_CLAIM_BATCH=str(self.claim_batch),
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        return env

    def settings(self) -> Settings:
        return Settings(
            database_url=self.db_url,
            broker_url=self.broker_url,
            downstream_url=self.sim_url,
            fingerprint_keys={"v1": FINGERPRINT_KEY},  # type: ignore[dict-item]
            idempotency_secret=IDEMPOTENCY_SECRET,  # type: ignore[arg-type]
        )

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen(
            argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir
        )
        log.close()
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # Celery: warm shutdown
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in list(self.procs):
            self.stop(proc)

    def log_tail(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


# -- PostgreSQL ------------------------------------------------------------------------------


@contextmanager
def throwaway_database(admin_url: str) -> Iterator[tuple[str, str]]:
    name = f"settled_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"{admin_url.rsplit('/', 1)[0]}/{name}".replace("postgresql://", "postgresql+psycopg://")
    try:
        yield name, url
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def settled_commits(admin_url: str, db_name: str, timeout: float = 30.0) -> int:
    """``xact_commit`` of the database once no backend is connected to it any more.

    A backend flushes its pending counters when it exits, before it leaves pg_stat_activity;
    the value is then read until it stops moving.
    """
    with psycopg.connect(admin_url, autocommit=True) as conn:

        def idle() -> bool:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (db_name,)
            ).fetchone()
            return row is not None and row[0] == 0

        poll(idle, timeout, "every backend of the benchmark database to exit", 0.05)
        last = -1
        stable = 0
        end = time.monotonic() + timeout
        while stable < 3 and time.monotonic() < end:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (db_name,)
            ).fetchone()
            value = int(row[0]) if row else 0
            stable = stable + 1 if value == last else 0
            last = value
            time.sleep(0.1)
        return last


def autovacuum_runs(db_url: str) -> int:
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(autovacuum_count + autoanalyze_count), 0) FROM pg_stat_user_tables"
        ).fetchone()
    return int(row[0]) if row else 0


def _listen(db_url: str, requests: Any, ready: Any) -> None:
    """The listener process: notes when each ``succeeded`` commit became visible, and answers
    ``(ids, timeout)`` with the times of those ids it saw (``None`` ends it)."""
    seen: dict[int, float] = {}
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        ready.set()
        while True:
            for note in conn.notifies(timeout=0.05):
                seen.setdefault(int(note.payload), time.time())
            if not requests.poll():
                continue
            request = requests.recv()
            if request is None:
                return
            ids, timeout = request
            end = time.monotonic() + timeout
            while not all(i in seen for i in ids) and time.monotonic() < end:
                for note in conn.notifies(timeout=0.05):
                    seen.setdefault(int(note.payload), time.time())
            requests.send({i: seen[i] for i in ids if i in seen})


class Notifications:
    """Times at which ``succeeded`` commits became visible: LISTEN on the trigger's channel,
    in a process of its own, so that the observer neither waits for the producer's GIL to
    note a time nor takes it from the producer."""

    def __init__(self, db_url: str) -> None:
        self.seen: dict[int, float] = {}
        self.commits = 1  # transactions the listener's connection ran (LISTEN)
        ctx = multiprocessing.get_context("spawn")
        self._requests, theirs = ctx.Pipe()
        ready = ctx.Event()
        self._process = ctx.Process(
            target=_listen, args=(db_url, theirs, ready), name="listen", daemon=True
        )
        self._process.start()
        if not ready.wait(60):
            self._process.kill()
            raise TimeoutError("the listener process did not start")

    def wait_for(self, ids: list[int], timeout: float) -> None:
        self._requests.send((ids, timeout))
        self.seen.update(self._requests.recv())
        missing = sum(i not in self.seen for i in ids)
        if missing:
            raise TimeoutError(f"{missing} operations did not succeed in {timeout:.0f} s")

    def close(self) -> None:
        with suppress(OSError):
            self._requests.send(None)
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()


# -- the parts measured ----------------------------------------------------------------------


def _sim_client(url: str, start_at: float, n: int, prefix: str) -> tuple[float, float]:
    from pydantic import SecretStr

    from workers.http_client import HttpGateway

    kind = default_registry().get("refund")
    deadline = datetime.now(UTC) + timedelta(hours=1)
    with HttpGateway(url, {TENANT: SecretStr(API_KEY)}, timeout=5.0) as gateway:
        while time.time() < start_at:
            time.sleep(0.001)
        began = time.time()
        for i in range(n):
            gateway.submit(
                tenant=TENANT,
                kind=kind,
                idempotency_key=f"{prefix}-{i}",
                params=PARAMS,
                deadline=deadline,
            )
        return began, time.time()


def measure_simulator(url: str, clients: int, total: int) -> float:
    """Refunds per second the simulator answers to ``clients`` processes, nothing else running."""
    per = max(1, total // clients)
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 2.0  # after every process has started
    with ctx.Pool(clients) as pool:
        spans = pool.starmap(
            _sim_client, [(url, start_at, per, f"sim-{c}") for c in range(clients)]
        )
    return per * clients / (max(e for _, e in spans) - min(b for b, _ in spans))


class Broker:
    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)

    def pending(self) -> int:
        """Messages queued or delivered but not yet acknowledged (acks_late: until done)."""
        return int(self.client.llen(QUEUE)) + int(self.client.hlen("unacked"))

    def close(self) -> None:
        self.client.close()


def wait_worker(app: Any, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError("worker exited at start")
        return bool(app.control.ping(timeout=0.3))

    poll(answers, timeout, "the worker to answer a ping")


# One worker runs at a time: ``limit=1`` returns at its reply, where a broadcast would wait
# the whole timeout for other workers' replies (a drain shorter than that would be timed as
# taking that long).


def pause(app: Any) -> None:
    replies = app.control.cancel_consumer(QUEUE, reply=True, timeout=5.0, limit=1)
    if not replies:
        raise RuntimeError("no worker confirmed cancel_consumer")


def resume(app: Any) -> None:
    replies = app.control.add_consumer(QUEUE, reply=True, timeout=5.0, limit=1)
    if not replies:
        raise RuntimeError("no worker confirmed add_consumer")


def measure_noop(svc: Services, n: int) -> float:
    """No-op tasks per second drained by a prefork worker with the product's Celery config."""
    app = create_app(svc.settings())
    broker = Broker(svc.broker_url)
    proc = svc.spawn(
        "noop-worker",
        [sys.executable, "-m", "bench.noop_app", f"--concurrency={svc.concurrency}",
         "--hostname=bench-noop@%h"],
    )  # fmt: skip
    try:
        wait_worker(app, proc)
        for i in range(2 * svc.concurrency):  # warm every child
            app.send_task(NOOP, args=[i], queue=QUEUE)
        poll(lambda: broker.pending() == 0, 30, "the warm-up no-ops")
        pause(app)
        for i in range(n):
            app.send_task(NOOP, args=[i], queue=QUEUE)
        queued = broker.pending()
        started = time.monotonic()
        resume(app)
        poll(lambda: broker.pending() == 0, 300, "the no-op drain", 0.002)
        elapsed = time.monotonic() - started
        if queued < n:
            print(f"  note: {n - queued} no-ops were consumed before the pause took effect")
        return queued / elapsed
    finally:
        svc.stop(proc)
        app.close()
        broker.close()


@dataclass
class PipelineResult:
    ops_per_second: float = 0.0
    intake_per_second: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    latency_rate: float = 0.0
    latency_per_commit: float = 0.0
    drained_ops: int = 0  # operations the workers handled in the counted phase
    worker_commits: int = 0
    commit_delta: int = 0
    bench_commits: int = 0


class Producer:
    """The backend app: intake in its own transactions, hints published after commit."""

    def __init__(self, svc: Services) -> None:
        settings = svc.settings()
        self.app = create_app(settings)
        self.engine = make_engine(svc.db_url, pool_pre_ping=False)
        self.commits = 0  # every COMMIT this engine sends (rollbacks are not xact_commit)
        event.listen(self.engine, "commit", self._count)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.committed_at: dict[int, float] = {}
        # Registered before the relay, so it runs first: the time is taken before publishing.
        event.listen(self.sessions, "after_commit", self._commit_time)
        relay.install(self.sessions, hint_publisher(self.app))
        self.outbox = Outbox.from_settings(settings, default_registry())
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
                        session, tenant=TENANT, op_id=f"op-{self.serial}-{uuid.uuid4().hex[:6]}",
                        kind="refund", params=PARAMS,
                    )  # fmt: skip
                    ids.append(got.operation.id)
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


def start_settled_worker(svc: Services, name: str) -> subprocess.Popen[bytes]:
    """``settled worker`` with beat, as in production: the sweeper re-hints retried operations."""
    return svc.spawn(
        name,
        [sys.executable, "-m", "settled.cli", "worker", "--pool=prefork",
         f"--concurrency={svc.concurrency}", "--loglevel=WARNING", "--beat",
         f"--hostname=bench-{name}@%h"],
    )  # fmt: skip


def measure_max_rate(svc: Services, n: int, warmup: int, result: PipelineResult) -> None:
    """Phase 1: maximum rate and worker-side commits (no LISTEN: its backend would commit).

    The backlog is taken in 100 operations per intake transaction, so the relay publishes one
    hint message per 20 operations (``outbox.relay.PER_MESSAGE``).
    """
    baseline = settled_commits(svc.admin_url, svc.db_name)
    producer = Producer(svc)
    counter = Counter(svc.db_url)
    try:
        result.ops_per_second, result.intake_per_second = drain(
            svc, producer, counter, "settled-worker-1", n, warmup, per_txn=100
        )
    finally:
        producer.close()
        counter.close()
    result.drained_ops = warmup + n
    result.commit_delta = settled_commits(svc.admin_url, svc.db_name) - baseline
    result.bench_commits = producer.commits + counter.commits
    result.worker_commits = result.commit_delta - result.bench_commits


def measure_single(svc: Services, n: int, warmup: int) -> float:
    """Phase 1b: the maximum rate when every intake transaction holds one operation (one hint
    message per operation: the Celery cost per message is paid by every operation)."""
    producer = Producer(svc)
    counter = Counter(svc.db_url)
    try:
        done_before = counter.succeeded()
        rate, _ = drain(
            svc, producer, counter, "settled-worker-3", n, warmup, per_txn=1, base=done_before
        )
        return rate
    finally:
        producer.close()
        counter.close()


def drain(
    svc: Services,
    producer: Producer,
    counter: Counter,
    name: str,
    n: int,
    warmup: int,
    *,
    per_txn: int,
    base: int = 0,
) -> tuple[float, float]:
    """Queue ``n`` operations while the worker's consumer is paused, then time the drain.

    Returns (operations per second from resuming to the last ``succeeded`` commit and the last
    hint consumed, intake operations per second). The worker is stopped before returning, so
    its backends exit and flush their counters.
    """
    broker = Broker(svc.broker_url)
    proc = start_settled_worker(svc, name)
    try:
        wait_worker(producer.app, proc)
        producer.intake(warmup, 1)
        counter.wait(base + warmup, 60)
        pause(producer.app)
        began = time.monotonic()
        producer.intake(n, per_txn)
        intake_rate = n / (time.monotonic() - began)
        started = time.time()
        resume(producer.app)
        done = counter.wait(base + warmup + n, 600)
        # Hints for operations a batch already took are still queued: their (empty) claims are
        # part of the cost, so the drain ends when they are consumed too.
        poll(lambda: broker.pending() == 0, 600, "the remaining hints", 0.002)
        return n / (max(done, time.time()) - started), intake_rate
    finally:
        svc.stop(proc)
        broker.close()


def measure_latency(
    svc: Services, m: int, rate: float, warmup: int, result: PipelineResult
) -> None:
    """Phase 2: commit-to-receipt latency, open loop at ``rate``, one operation per commit.

    The NOTIFY trigger is installed only now: notifying commits take a database-wide lock at
    commit, which would serialise the commits of the max-rate phase.
    """
    with psycopg.connect(libpq(svc.db_url), autocommit=True) as conn:
        conn.execute(NOTIFY_TRIGGER)
    producer = Producer(svc)
    notes = Notifications(svc.db_url)
    proc = start_settled_worker(svc, "settled-worker-2")
    try:
        wait_worker(producer.app, proc)
        notes.wait_for(producer.intake(warmup, 1), 60)
        ids: list[int] = []
        commits = 0
        t0 = time.monotonic()
        while len(ids) < m:
            # Open loop: operation k arrives at t0 + k / rate; one transaction commits every
            # operation that has arrived (one at a time while the producer keeps up).
            due = t0 + len(ids) / rate
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            arrived = 1 + int((time.monotonic() - due) * rate)
            count = min(m - len(ids), arrived)
            ids += producer.intake(count, count)
            commits += 1
        result.latency_rate = m / (time.monotonic() - t0)
        result.latency_per_commit = m / commits
        notes.wait_for(ids, 120)
        result.latencies_ms = [(notes.seen[i] - producer.committed_at[i]) * 1000 for i in ids]
        if result.latency_rate < 0.95 * rate:
            print(f"  note: the producer reached {result.latency_rate:.0f}/s of {rate:.0f}/s")
    finally:
        svc.stop(proc)
        notes.close()
        producer.close()


def verify(db_url: str) -> tuple[int, int]:
    """Operations succeeded with a receipt, and all operations (run after the counters)."""
    engine = make_engine(db_url)
    try:
        with Session(engine) as s:
            done = s.scalar(
                select(func.count()).where(
                    Operation.state == "succeeded", Operation.receipt.is_not(None)
                )
            )
            total = s.scalar(select(func.count()).select_from(Operation))
            retried = s.scalar(select(func.count()).where(Operation.attempts > 1))
    finally:
        engine.dispose()
    if retried:
        print(f"  note: {retried} operations needed more than one attempt (not sent: retried)")
    return int(done or 0), int(total or 0)


def measure_raw_sql(db_url: str, threads: int, n: int) -> float:
    """Insert, fenced claim, fenced outcome (three commits) per operation, ``threads`` at once."""
    url = libpq(db_url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(RAW_TABLE)
    per = max(1, n // threads)
    barrier = threading.Barrier(threads + 1)

    def lifecycle(worker: int) -> None:
        with psycopg.connect(url) as conn:
            barrier.wait()
            for _ in range(per):
                (op,) = conn.execute(
                    "INSERT INTO bench_raw (params) VALUES (%s) RETURNING id",
                    (json.dumps(PARAMS),),
                ).fetchone()  # type: ignore[misc]
                conn.commit()
                (version,) = conn.execute(
                    "UPDATE bench_raw SET lease_owner = %s,"
                    " lease_until = clock_timestamp() + interval '60 seconds',"
                    " lease_version = lease_version + 1, state = 'submitted'"
                    " WHERE id = %s AND state = 'planned'"
                    " AND (lease_until IS NULL OR lease_until < clock_timestamp())"
                    " RETURNING lease_version",
                    (f"raw-{worker}", op),
                ).fetchone()  # type: ignore[misc]
                conn.commit()
                conn.execute(
                    "UPDATE bench_raw SET state = 'succeeded', receipt = %s,"
                    " lease_owner = NULL, lease_until = NULL"
                    " WHERE id = %s AND lease_version = %s AND state = 'submitted'",
                    (json.dumps({"reference": f"re_{op}"}), op, version),
                )
                conn.commit()

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(lifecycle, w) for w in range(threads)]
        barrier.wait()
        started = time.monotonic()
        for f in futures:
            f.result()
    return per * threads / (time.monotonic() - started)


# -- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=3000, help="operations in the max-rate drain")
    parser.add_argument("--latency-ops", type=int, default=1000, help="operations at half rate")
    parser.add_argument(
        "--single-ops", type=int, default=1000, help="operations, one per intake commit"
    )
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--noop-tasks", type=int, default=None, help="default: 2 × --ops")
    parser.add_argument("--raw-ops", type=int, default=3000)
    parser.add_argument("--sim-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=4, help="prefork children")
    parser.add_argument(
        "--claim-batch", type=int, default=None, help="SETTLED_CLAIM_BATCH (default: settings)"
    )
    parser.add_argument("--latency-rate", type=float, default=None, help="default: half max")
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/14", help="flushed!")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument(
        "--log-statements", action="store_true", help="log every statement to the server log"
    )
    args = parser.parse_args(argv)
    claim_batch = Settings().claim_batch if args.claim_batch is None else args.claim_batch

    workdir = Path(tempfile.mkdtemp(prefix="settled-bench-"))
    broker = redis.Redis.from_url(args.redis)
    broker.flushdb()
    broker.close()
    sim_port = free_port()
    with throwaway_database(args.pg) as (db_name, db_url):
        upgrade(db_url)
        with psycopg.connect(libpq(db_url), autocommit=True) as conn:
            if args.log_statements:
                conn.execute(f"ALTER DATABASE \"{db_name}\" SET log_statement = 'all'")
            sync = conn.execute("SHOW synchronous_commit").fetchone()
        svc = Services(
            admin_url=args.pg,
            db_name=db_name,
            db_url=db_url,
            broker_url=args.redis,
            sim_url=f"http://127.0.0.1:{sim_port}",
            workdir=workdir,
            concurrency=args.concurrency,
            claim_batch=claim_batch,
        )
        try:
            svc.spawn(
                "simulator",
                [sys.executable, "-m", "settled.cli", "simulator", "--port", str(sim_port),
                 "--ledger", ":memory:", "--test-mode", "--tenant", f"{TENANT}={API_KEY}"],
            )  # fmt: skip
            from settled.simulator import SimulatorControl

            def sim_up() -> bool:
                try:
                    with SimulatorControl(svc.sim_url) as control:
                        control.create_order(TENANT, ORDER, 10**15)
                    return True
                except Exception:
                    return False

            poll(sim_up, 30, "the simulator", 0.1)
            print(f"PostgreSQL synchronous_commit={sync[0] if sync else '?'}; "
                  f"{os.cpu_count()} cores; prefork concurrency {args.concurrency}; "
                  f"claim_batch {claim_batch}")  # fmt: skip
            print("measuring the simulator alone ...", flush=True)
            sim_rate = measure_simulator(svc.sim_url, args.concurrency, args.sim_requests)
            print("measuring the no-op Celery drain ...", flush=True)
            noop_rate = measure_noop(svc, args.noop_tasks or 2 * args.ops)
            result = PipelineResult()
            print("measuring the pipeline at its maximum rate ...", flush=True)
            vacuums = autovacuum_runs(db_url)
            measure_max_rate(svc, args.ops, args.warmup, result)
            vacuums = autovacuum_runs(db_url) - vacuums
            print("measuring the pipeline with one operation per intake commit ...", flush=True)
            single_rate = measure_single(svc, args.single_ops, args.warmup)
            rate = args.latency_rate or result.ops_per_second / 2
            print(f"measuring commit-to-receipt latency at {rate:.0f} ops/s ...", flush=True)
            measure_latency(svc, args.latency_ops, rate, args.warmup, result)
            done, total = verify(db_url)
            print("measuring the raw-SQL lifecycle ...", flush=True)
            raw_rate = measure_raw_sql(db_url, args.concurrency, args.raw_ops)
        except BaseException:
            for name in ("simulator", "noop-worker", *(f"settled-worker-{i}" for i in (1, 2, 3))):
                tail = svc.log_tail(name)
                if tail:
                    print(f"--- {name} log (tail)\n{tail}", file=sys.stderr)
            raise
        finally:
            svc.stop_all()

    per_op = result.worker_commits / result.drained_ops
    p50 = statistics.median(result.latencies_ms)
    p99 = pct(result.latencies_ms, 0.99)
    ratio = result.ops_per_second / noop_rate
    rows = [
        ("end-to-end ops/s (commit → succeeded)", f"{result.ops_per_second:8.0f}",
         f">= {0.6 * noop_rate:.0f} (0.6 × no-op; stretch {0.8 * noop_rate:.0f})"),
        ("  as a fraction of the no-op drain", f"{ratio:8.2f}", ">= 0.60 (stretch 0.80)"),
        ("  same, one operation per intake commit", f"{single_rate:8.0f}",
         f"reference ({single_rate / noop_rate:.2f} × no-op)"),
        (f"latency p50 at {result.latency_rate:.0f} ops/s", f"{p50:6.1f} ms", "<= 20 ms"),
        (f"latency p99 at {result.latency_rate:.0f} ops/s", f"{p99:6.1f} ms", "<= 100 ms"),
        ("  operations per intake commit then", f"{result.latency_per_commit:8.2f}", "reference"),
        ("worker-side commits per operation", f"{per_op:8.2f}", "<= 2.2"),
        ("no-op Celery drain, tasks/s", f"{noop_rate:8.0f}", "reference"),
        ("raw-SQL lifecycle (3 commits), ops/s", f"{raw_rate:8.0f}", "reference"),
        ("simulator alone, requests/s", f"{sim_rate:8.0f}", "reference"),
        ("intake (bench, 100 per txn), ops/s", f"{result.intake_per_second:8.0f}", "reference"),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'figure':<{width}}  {'measured':>10}  target")
    print(f"{'-' * width}  {'-' * 10}  {'-' * 40}")
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:>10}  {target}")
    print()
    print(
        f"operations: {done} of {total} succeeded with a receipt. Commits counted over the "
        f"max-rate phase ({result.drained_ops} operations): xact_commit delta "
        f"{result.commit_delta}, of which the benchmark's own {result.bench_commits} (intake "
        f"transactions, completion polls); autovacuum/autoanalyze runs then: {vacuums}"
    )
    if args.keep_logs:
        print(f"logs: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    with suppress(redis.RedisError):
        broker = redis.Redis.from_url(args.redis)
        broker.flushdb()
        broker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
