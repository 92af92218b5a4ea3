"""PostgreSQL really unreachable (a private cluster of the test's own, stopped and started
again): what a worker and beat say about it, and what they do meanwhile.

The issue (45, finding 3): during an outage workers logged ``outcome refused by the database;
to review`` and ``could not record the operation`` though nothing was refused and no review
item was ever opened, and beat logged ``proposal expiry failed; sweeping anyway`` and a
failed task every beat. Now an outage is one line when it starts (``database unreachable;
retrying``, with what waits) and one when it ends (``database reachable again after N s``),
per process; an outcome back from the downstream meanwhile waits in memory and is written
when the database answers (``workers.outcomes``), and beat's tasks are skipped quietly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from outbox.db import make_engine, upgrade
from outbox.intake import Outbox
from outbox.outage import DatabaseOutage
from settled.simulator import SimulatorControl, SimulatorHandle
from tests.integration.test_celery_worker import App
from tests.support.rig import Rig
from tests.support.services import PostgresCluster, postgres_cluster
from tests.support.simtools import SimTenant, wait_until
from tests.support.stack import Stack
from workers.executor import Executor

pytestmark = [pytest.mark.postgres]

UNREACHABLE = "database unreachable; retrying"
#: what a worker must never say of a database that was merely away
UNTRUE = ("to review", "refused by the database", "could not record", "expiry failed")


@dataclass
class Private:
    cluster: PostgresCluster
    url: str
    engine: Engine


@pytest.fixture
def private() -> Iterator[Private]:
    """A migrated database on a PostgreSQL cluster of this test's own, to stop and start."""
    with postgres_cluster() as cluster:
        with psycopg.connect(cluster.url, autocommit=True) as conn:
            conn.execute("CREATE DATABASE settled")
        url = f"postgresql+psycopg://postgres@127.0.0.1:{cluster.port}/settled"
        upgrade(url)
        engine = make_engine(url)
        try:
            yield Private(cluster, url, engine)
        finally:
            engine.dispose()


def said(caplog: pytest.LogCaptureFixture, start: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]


def untrue(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(u in line for u in UNTRUE)]


def test_an_outcome_back_while_the_database_is_down_is_written_when_it_answers_again(
    private: Private,
    outbox: Outbox,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    simulator: SimulatorHandle,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The refund is carried out downstream while PostgreSQL is stopped: the worker keeps the
    receipt, says the outage once, writes ``succeeded`` when the database is back and says
    that once; nothing is put in review, nothing is called refused."""
    sim_control.create_order("acme", "A1042", 100000)
    sessions = sessionmaker(private.engine, expire_on_commit=False)
    rig = Rig(private.engine, outbox, sim_control, sim_tenant, simulator.url, sessions)
    try:
        op = rig.enqueue()
        executor = Executor(
            sessions=sessions,
            gateway=rig.gateway(timeout=20.0),  # the held answer comes back after the stop
            registry=outbox.registry,
            fingerprinter=outbox.fingerprinter,
            worker="w1",
            outage=DatabaseOutage(),
            outcome_patience=60.0,
        )
        sim_control.add_rule("hold_before_commit", hold_seconds=20)
        written: dict[int, str] = {}
        worker = threading.Thread(
            target=lambda: written.update(executor.execute([op])), name="worker"
        )
        with caplog.at_level(logging.INFO):
            worker.start()
            sim_control.wait_in_flight("acme", rig.op(op).idempotency_key, timeout=10)
            private.cluster.stop("fast")
            sim_control.release_holds()  # carried out now; the answer finds no database
            wait_until(
                lambda: bool(said(caplog, "database unreachable")), 20, "the outage to be said"
            )
            private.cluster.start()
            worker.join(60)
            assert not worker.is_alive()
        executor.close()
        assert written == {op: "succeeded"}
        assert rig.op(op).state == "succeeded" and rig.effects(op) == 1
        assert rig.reviews(op) == []
        # Said once (with the write waiting, unless the lease keeper's renewal failed first).
        (away,) = said(caplog, "database unreachable")
        assert away in ("database unreachable; retrying (1 write waiting)", UNREACHABLE), away
        (back,) = said(caplog, "database reachable again")
        assert back.endswith("; 1 write retried, 0 tasks skipped meanwhile"), back
        assert untrue(caplog.text) == []
        rig.check_truthful()
    finally:
        rig.close()


@pytest.mark.slow
@pytest.mark.redis
def test_beat_is_quiet_while_the_database_is_down_and_says_when_it_is_back(
    private: Private,
    redis_url: str,
    simulator: SimulatorHandle,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    outbox: Outbox,
    tmp_path: Path,
) -> None:
    """A real worker with beat (solo: one process, one view of the outage) over a stopped
    PostgreSQL: beat keeps sending its sweeps, none is logged as failed, the proposal expiry
    says nothing; one line when the outage starts, one when it ends, and a refund enqueued
    after settles."""
    sim_control.create_order("acme", "A1042", 10**9)
    stack = Stack(
        database_url=private.url,
        broker_url=redis_url,
        downstream_url=simulator.url,
        api_keys={sim_tenant.name: sim_tenant.api_key.get_secret_value()},
        workdir=tmp_path,
    )
    app = App(stack, private.engine, outbox)
    try:
        worker = stack.start_worker(beat=True, pool="solo")

        def log() -> str:
            return stack.log_of(worker)

        def after_outage() -> str:
            return log().partition("database unreachable")[2]

        wait_until(lambda: '"msg": "sweep"' in log() or "Sending due task sweep" in log(), 60)
        private.cluster.stop("fast")
        wait_until(lambda: "database unreachable" in log(), 30, "the outage to be said")
        # Ten sweeps sent by beat and worked by the worker while the database is away.
        wait_until(lambda: after_outage().count("settled.sweep[") >= 20, 30, "ten sweeps")
        private.cluster.start()
        wait_until(lambda: "database reachable again" in log(), 30, "the return to be said")
        ids = app.enqueue(1, prefix="after")
        wait_until(lambda: app.states(ids) == {ids[0]: "succeeded"}, 30, "the refund to settle")
        text = log()
        assert text.count("database unreachable; retrying (1 task skipped)") == 1, text
        assert text.count("database reachable again after") == 1, text
        assert "raised unexpected" not in text, text
        assert untrue(text) == [], text
    finally:
        stack.stop_all()
        app.close()
