"""What every phase uses: the services of a run, PostgreSQL's counters, Celery control."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis

from outbox.kinds import default_registry
from outbox.settings import Settings
from settled.celery_app import QUEUE

ROOT = Path(__file__).resolve().parents[2]

TENANT = "acme"
API_KEY = "sk_test_bench_0c5e7a91"  # a throwaway key of the throwaway simulator
FINGERPRINT_KEY = "bench-fingerprint-key-0001"
IDEMPOTENCY_SECRET = "bench-idempotency-secret"
ORDER = "B-1"
PARAMS = {"order_id": ORDER, "amount_minor": 1, "currency": "CNY", "payee": "P-1"}


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


# -- the services of a run -------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoints:
    """Where the product's processes find the database, the broker and the downstream: what a
    producer process needs (picklable, unlike ``Services``)."""

    db_url: str  # SQLAlchemy URL of the throwaway database
    broker_url: str
    sim_url: str
    doorbell: int = 0  # SETTLED_HINT_DOORBELL, the producers' and the workers'
    claim_batch: int = Settings().claim_batch

    def settings(self) -> Settings:
        return Settings(
            database_url=self.db_url,
            broker_url=self.broker_url,
            downstream_url=self.sim_url,
            fingerprint_keys={"v1": FINGERPRINT_KEY},
            idempotency_secret=IDEMPOTENCY_SECRET,
            hint_doorbell=self.doorbell,
            claim_batch=self.claim_batch,
        )


@dataclass
class Services:
    admin_url: str  # libpq URL of the maintenance database
    db_name: str
    endpoints: Endpoints
    workdir: Path
    concurrency: int
    pool: str
    claim_batch: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def db_url(self) -> str:
        return self.endpoints.db_url

    @property
    def broker_url(self) -> str:
        return self.endpoints.broker_url

    @property
    def sim_url(self) -> str:
        return self.endpoints.sim_url

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
        env.update(
            SETTLED_DATABASE_URL=self.db_url,
            SETTLED_BROKER_URL=self.broker_url,
            SETTLED_DOWNSTREAM_URL=self.sim_url,
            SETTLED_DOWNSTREAM_API_KEYS=json.dumps({TENANT: API_KEY}),
            SETTLED_DOWNSTREAM_TIMEOUT="5.0",
            # The downstream is the simulator, which refuses requests past their deadline.
            SETTLED_DOWNSTREAM_CONTRACTS=json.dumps(
                {name: {"enforces_deadline": True} for name in default_registry().names()}
            ),
            SETTLED_FINGERPRINT_KEYS=json.dumps({"v1": FINGERPRINT_KEY}),
            SETTLED_IDEMPOTENCY_SECRET=IDEMPOTENCY_SECRET,
            SETTLED_LEASE_SECONDS="30",
            SETTLED_CLAIM_BATCH=str(self.claim_batch),
            SETTLED_HINT_DOORBELL=str(self.endpoints.doorbell),
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        return env

    def settings(self) -> Settings:
        return self.endpoints.settings()

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

    def logs(self) -> list[str]:
        """Names of the logs written so far (one per process started)."""
        return sorted(p.stem for p in self.workdir.glob("*.log"))

    def log_tail(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def start_settled_worker(svc: Services, name: str) -> subprocess.Popen[bytes]:
    """``settled worker`` with beat, as in production: the sweeper re-hints retried operations."""
    return svc.spawn(
        name,
        [sys.executable, "-m", "settled.cli", "worker", f"--pool={svc.pool}",
         f"--concurrency={svc.concurrency}", "--loglevel=WARNING", "--beat",
         f"--hostname=bench-{name}@%h"],
    )  # fmt: skip


# -- PostgreSQL ------------------------------------------------------------------------------


@contextmanager
def throwaway_database(admin_url: str, tag: str = "") -> Iterator[tuple[str, str]]:
    """A database of its own (name, SQLAlchemy URL), dropped at the end."""
    name = f"settled_bench_{tag}{os.getpid()}_{uuid.uuid4().hex[:6]}"
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


# -- the broker and Celery's control ---------------------------------------------------------


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
