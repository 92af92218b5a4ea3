"""References beside the pipeline: the simulator alone, and a raw-SQL lifecycle."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import psycopg

from bench.phases.common import API_KEY, PARAMS, TENANT, libpq
from outbox.downstream import DownstreamRequest
from outbox.kinds import default_registry

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
                DownstreamRequest(TENANT, f"{prefix}-{i}", kind, f"{prefix}-{i}", PARAMS),
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
