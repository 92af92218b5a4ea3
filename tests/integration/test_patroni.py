"""Patroni failover under load (issue 45): a Patroni pair with synchronous replication
(``tests.support.patroni``), Settled given both hosts (``target_session_attrs=read-write``, as
docs/production.md says), an app committing one refund per transaction while a real Celery
worker (prefork, with beat's sweeper) sends them to the simulator; the leader's host is killed
mid-load. Judged by the simulator's ledger: every refund the app saw committed is on the new
primary and done exactly once (0 lost, 0 dup), every state true. The recovery time (kill to
the app's next commit) is printed, never asserted. The old leader, started again, comes back
as a standby and takes no write.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine

from outbox.db import make_engine, upgrade
from outbox.intake import Outbox
from settled.simulator import SimulatorControl, SimulatorHandle
from tests.integration.test_celery_worker import App
from tests.support.load import Producer, judge_committed
from tests.support.patroni import PatroniPair
from tests.support.simtools import SimTenant, wait_until
from tests.support.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

#: refunds the app commits before the leader is killed, and after the new one takes writes
BEFORE, AFTER = 15, 15


@pytest.fixture
def patroni() -> Iterator[PatroniPair]:
    pair = PatroniPair()
    try:
        pair.start()
        yield pair
    finally:
        pair.stop()


@pytest.fixture
def database(patroni: PatroniPair) -> Iterator[Engine]:
    with psycopg.connect(patroni.leader().dsn, autocommit=True) as conn:
        conn.execute("CREATE DATABASE settled")
    url = patroni.url("settled")
    upgrade(url)
    engine = make_engine(url)
    yield engine
    engine.dispose()


@pytest.fixture
def stack(
    patroni: PatroniPair,
    database: Engine,
    redis_url: str,
    simulator: SimulatorHandle,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    tmp_path: Path,
) -> Iterator[Stack]:
    sim_control.create_order("acme", "A1042", 10**9)
    s = Stack(
        database_url=patroni.url("settled"),
        broker_url=redis_url,
        downstream_url=simulator.url,
        api_keys={sim_tenant.name: sim_tenant.api_key.get_secret_value()},
        workdir=tmp_path,
    )
    yield s
    s.stop_all()


def test_the_leaders_host_killed_under_load_loses_no_refund_and_sends_none_twice(
    patroni: PatroniPair,
    database: Engine,
    stack: Stack,
    outbox: Outbox,
    sim_control: SimulatorControl,
) -> None:
    app = App(stack, database, outbox)
    producer = Producer(app, outbox)
    try:
        worker = stack.start_worker(pool="prefork", concurrency=2, beat=True)
        # started (its start checks the schema and probes the fence) before the load begins
        wait_until(
            lambda: "deadline fence verified" in stack.log_of(worker), 60, "the worker's start"
        )
        producer.start()
        wait_until(lambda: len(producer.committed) >= BEFORE, 60, "the load before the kill")
        old = patroni.leader()
        patroni.kill(old)
        at_kill = producer.mark()  # the host gone: every commit from here is the new leader's
        # The app goes on; its commits fail until the standby has promoted itself.
        wait_until(
            lambda: len(producer.committed) >= at_kill + AFTER or producer.error is not None,
            90,
            "the load after the failover",
        )
        producer.finish()
        assert producer.failures > 0, "no commit failed: the kill did not reach the app"
        assert patroni.leader() is not old
        ids = judge_committed(app, stack, producer, sim_control)
        print(
            f"patroni failover under load: {len(ids)} refunds, {producer.failures} failed "
            f"commits, the app committing again {producer.recovered:.1f} s after the leader's "
            "host was killed"
        )

        # The old leader's host comes back: as a standby, taking no write, from its first
        # answer on.
        patroni.start_node(old)
        answered_as: list[bool] = []

        def back_as_standby() -> bool:
            try:
                with psycopg.connect(old.dsn, connect_timeout=2) as conn:
                    row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
                    answered_as.append(bool(row and row[0]))
            except psycopg.OperationalError:
                return False  # not accepting connections yet
            return old.role() == "replica"

        wait_until(back_as_standby, 60, "the old leader to come back")
        assert answered_as and all(answered_as), answered_as
        with (
            psycopg.connect(old.dsn, autocommit=True) as conn,
            pytest.raises(psycopg.errors.ReadOnlySqlTransaction),
        ):
            conn.execute("CREATE TABLE written_on_the_old_leader ()")
    except BaseException:
        print(stack.logs())
        print(patroni.logs())
        raise
    finally:
        producer.stopping.set()
        app.close()
