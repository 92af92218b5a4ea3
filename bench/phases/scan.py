"""Scan flatness: the sweeper's pass and the reconciler's pass with a small and a large
operations table, the live part the same in both.

The table is filled on the server (``INSERT ... SELECT generate_series``) in a throwaway
database of its own: the same live operations at both sizes (``live`` that are waiting for
something not yet due: planned with a retry later, unknown with the next look later,
submitted with a lease held; and ``due`` planned operations due now), and terminal ones
(succeeded, and a few rejected and cancelled) for the rest. Growing from the small size to the
large one adds terminal operations only: what a table collects over months. Both sizes are
measured after ``VACUUM ANALYZE``, as autovacuum leaves a table in steady state.

The passes are the product's own: ``workers.sweeper.sweep`` (the due ids, published to a list
here instead of the broker: it re-hints the ``due`` operations every time) and
``reconciler.reconcile.Reconciler.run_once`` (nothing is due for a look, so a pass is its
claim that finds nothing and the age of the oldest unknown operation: its scans alone, and
the pass changes nothing, so every repetition is the same pass). Each is timed ``repeats``
times after one untimed pass, on a connection already open; the median is reported.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psycopg
from sqlalchemy.orm import sessionmaker

from bench.phases.common import PARAMS, TENANT, libpq, throwaway_database
from outbox.db import make_engine, upgrade
from outbox.kinds import default_registry
from outbox.testing import FakeGateway
from reconciler.reconcile import Reconciler
from workers.sweeper import sweep

_COLUMNS = """tenant, op_id, kind, params, fingerprint, fingerprint_key_version, idempotency_key,
    state, reason, attempts, max_attempts, deadline, next_attempt_at, first_sent_at,
    unknown_since, lease_owner, lease_until, lease_version, receipt, downstream_ref"""

#: Terminal operations ``first``..``last``: 98 % succeeded, 1 % rejected, 1 % cancelled.
FILL_TERMINAL = f"""
INSERT INTO operations ({_COLUMNS})
SELECT %(tenant)s, 'scan-t-' || g, 'refund', %(params)s::json, md5(g::text), 'v1', md5('k' || g),
    s.state, CASE WHEN s.state = 'rejected' THEN 'business_rejected' END,
    CASE WHEN s.state = 'cancelled' THEN 0 ELSE 1 END, 5,
    now() + interval '1 day', now() - interval '1 day',
    CASE WHEN s.state = 'cancelled' THEN NULL ELSE now() - interval '1 day' END,
    NULL, NULL, NULL, 1,
    CASE WHEN s.state = 'succeeded' THEN json_build_object('reference', 're_' || g) END,
    CASE WHEN s.state = 'succeeded' THEN 're_' || g END
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g,
    LATERAL (SELECT CASE g %% 100 WHEN 0 THEN 'rejected' WHEN 1 THEN 'cancelled'
                     ELSE 'succeeded' END AS state) AS s
"""

#: Live operations not due now, in turn planned (a retry later), unknown (the next look
#: later) and submitted (a lease held).
FILL_LIVE = f"""
INSERT INTO operations ({_COLUMNS})
SELECT %(tenant)s, 'scan-l-' || g, 'refund', %(params)s::json, md5(g::text), 'v1', md5('l' || g),
    s.state, NULL, 1, 5, now() + interval '1 day', now() + interval '1 hour',
    CASE WHEN s.state <> 'planned' THEN now() - interval '1 hour' END,
    CASE WHEN s.state = 'unknown' THEN now() - interval '1 hour' END,
    CASE WHEN s.state = 'submitted' THEN 'bench-scan' END,
    CASE WHEN s.state = 'submitted' THEN now() + interval '1 day' END,
    1, NULL, NULL
FROM generate_series(1, %(count)s::bigint) AS g,
    LATERAL (SELECT (ARRAY['planned', 'unknown', 'submitted'])[1 + g %% 3] AS state) AS s
"""

#: Planned operations due now: the sweeper re-hints them at every pass.
FILL_DUE = f"""
INSERT INTO operations ({_COLUMNS})
SELECT %(tenant)s, 'scan-d-' || g, 'refund', %(params)s::json, md5(g::text), 'v1', md5('d' || g),
    'planned', NULL, 0, 5, now() + interval '1 day', now() - interval '1 minute',
    NULL, NULL, NULL, NULL, 0, NULL, NULL
FROM generate_series(1, %(count)s::bigint) AS g
"""


@dataclass
class ScanResult:
    sizes: tuple[int, int]
    sweep_ms: tuple[float, float]  # median pass at each size
    reconcile_ms: tuple[float, float]
    hinted: int  # operations a sweep re-hinted (the same at both sizes)
    fill_seconds: float  # filling and vacuuming the large table

    @property
    def sweep_ratio(self) -> float:
        return self.sweep_ms[1] / self.sweep_ms[0]

    @property
    def reconcile_ratio(self) -> float:
        return self.reconcile_ms[1] / self.reconcile_ms[0]


def _timed(step: Callable[[], object], repeats: int) -> float:
    step()  # untimed: connections, statement caches
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def _rows(conn: psycopg.Connection[tuple[int]]) -> int:
    row = conn.execute("SELECT count(*) FROM operations").fetchone()
    return int(row[0]) if row else 0


def measure_scans(
    admin_url: str, *, small: int, large: int, live: int, due: int, repeats: int
) -> ScanResult:
    """The median sweeper and reconciler pass at ``small`` and at ``large`` operations."""
    params = {"tenant": TENANT, "params": json.dumps(PARAMS)}
    with throwaway_database(admin_url, "scan_") as (_, db_url):
        upgrade(db_url)
        engine = make_engine(db_url)
        sessions = sessionmaker(engine, expire_on_commit=False)
        hinted: list[int] = []

        def publish(ids: Sequence[int]) -> None:
            hinted.extend(ids)

        reconciler = Reconciler(
            sessions=sessions, gateway=FakeGateway(), registry=default_registry(),
            worker="bench-scan",
        )  # fmt: skip

        def sweep_pass() -> None:
            hinted.clear()
            sweep(sessions, publish)

        def reconcile_pass() -> None:
            report = reconciler.run_once()
            if report.claimed:
                raise RuntimeError("the reconciler found work in the scan table")

        try:
            with psycopg.connect(libpq(db_url), autocommit=True) as conn:
                conn.execute(FILL_LIVE, {**params, "count": live})
                conn.execute(FILL_DUE, {**params, "count": due})
                terminal = max(0, small - live - due)
                conn.execute(FILL_TERMINAL, {**params, "first": 1, "last": terminal})
                conn.execute("VACUUM ANALYZE operations")
                small_rows = _rows(conn)
                sweep_small = _timed(sweep_pass, repeats)
                hinted_small = len(hinted)
                reconcile_small = _timed(reconcile_pass, repeats)
                began = time.monotonic()
                conn.execute(
                    FILL_TERMINAL,
                    {**params, "first": terminal + 1, "last": max(terminal, large - live - due)},
                )
                conn.execute("VACUUM ANALYZE operations")
                fill_seconds = time.monotonic() - began
                sweep_large = _timed(sweep_pass, repeats)
                reconcile_large = _timed(reconcile_pass, repeats)
                if len(hinted) != hinted_small:
                    raise RuntimeError("the sweeper found other operations in the large table")
                large_rows = _rows(conn)
        finally:
            reconciler.close()
            engine.dispose()
    return ScanResult(
        sizes=(small_rows, large_rows),
        sweep_ms=(sweep_small, sweep_large),
        reconcile_ms=(reconcile_small, reconcile_large),
        hinted=hinted_small,
        fill_seconds=fill_seconds,
    )
