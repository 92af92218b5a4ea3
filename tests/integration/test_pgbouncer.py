"""Settled through PgBouncer (Debian's 1.18), in session and in transaction pool mode.

psycopg 3 prepares a statement on the server once it has run five times on a connection; in
transaction mode the next transaction may run on another server connection, which does not
know the name, or the name is taken there by another client's statement (PgBouncer supports
prepared statements in transaction mode only from 1.21). ``?prepare_threshold=none`` on
``SETTLED_DATABASE_URL`` turns that off (``outbox.db.make_engine``). Judged by the operations
table and the simulator's ledger.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError

from outbox.db import check_schema, make_engine
from outbox.errors import SettledError
from outbox.intake import Outbox
from settled.simulator import SimulatorControl, SimulatorHandle
from tests.integration import test_approval_races as races
from tests.integration.test_celery_worker import App, assert_at_most_one_effect, wait_settled
from tests.support.load import Producer, judge_committed
from tests.support.pgbouncer import PgBouncer, pgbouncer
from tests.support.rig import Rig
from tests.support.simtools import SimTenant, wait_until
from tests.support.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

NO_PREPARE = "?prepare_threshold=none"


def run_statements(engine: Engine, times: int = 8) -> None:
    """The same statement ``times`` times on each of two connections held at once, one
    transaction each (as two worker threads run their claims)."""
    with engine.connect() as a, engine.connect() as b:
        for _ in range(times):
            for conn in (a, b):
                assert conn.execute(text("SELECT count(*) FROM operations")).scalar_one() == 0
                conn.commit()


def test_server_side_prepares_break_transaction_pooling_unless_turned_off(
    pg: Engine, pg_url: str
) -> None:
    with pgbouncer(pg_url, "transaction", pool_size=1) as url:
        prepared = make_engine(url)
        with pytest.raises(DBAPIError) as failed:
            run_statements(prepared)
        assert isinstance(
            failed.value.orig,
            psycopg.errors.DuplicatePreparedStatement | psycopg.errors.InvalidSqlStatementName,
        )
        prepared.dispose()
        unprepared = make_engine(url + NO_PREPARE)
        run_statements(unprepared)
        unprepared.dispose()


def test_a_prepare_threshold_that_is_not_a_number_is_refused_in_one_line(pg_url: str) -> None:
    with pytest.raises(SettledError) as refused:
        make_engine(pg_url + "?prepare_threshold=never")
    assert refused.value.code == "invalid_setting"
    assert "prepare_threshold must be a whole number or none" in refused.value.message


@pytest.mark.parametrize("pool_mode", ["session", "transaction"])
def test_a_worker_through_pgbouncer_sends_and_reconciles_each_refund_once(
    pool_mode: str,
    pg: Engine,
    pg_url: str,
    redis_url: str,
    outbox: Outbox,
    simulator: SimulatorHandle,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    tmp_path: Path,
) -> None:
    """Intake, a real worker's claims, sends and outcomes, and beat's reconcile pass of a
    refund whose response was lost, all through PgBouncer (transaction mode with
    ``prepare_threshold=none``); more refunds than the prepare threshold, so every statement
    runs often enough to be prepared where that is on."""
    sim_control.create_order("acme", "A1042", 10**9)
    sim_control.add_rule("commit_then_reset", "*", times=1)  # one refund goes to unknown
    with pgbouncer(pg_url, pool_mode) as bounced:
        url = bounced + (NO_PREPARE if pool_mode == "transaction" else "")
        check_schema(url)
        stack = Stack(
            database_url=url,
            broker_url=redis_url,
            downstream_url=simulator.url,
            api_keys={sim_tenant.name: sim_tenant.api_key.get_secret_value()},
            workdir=tmp_path,
        )
        engine = make_engine(url)
        app = App(stack, engine, outbox)
        try:
            stack.start_worker(beat=True, pool="threads", concurrency=4)
            ids = app.enqueue(12)
            states = wait_settled(app, stack, ids)
            assert set(states.values()) == {"succeeded"}, states
            assert assert_at_most_one_effect(app, sim_control, ids) == [1] * 12
            reconciled = [i for i in ids if "unknown" in app.path(i)]
            assert len(reconciled) == 1, [app.path(i) for i in ids]
            assert app.path(reconciled[0]) == ["planned", "submitted", "unknown", "succeeded"]
            assert "prepared statement" not in stack.logs()
        finally:
            stack.stop_all()
            app.close()
            engine.dispose()


def test_pgbouncer_restarted_under_load_loses_no_refund_and_sends_none_twice(
    pg: Engine,
    pg_url: str,
    redis_url: str,
    outbox: Outbox,
    simulator: SimulatorHandle,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    tmp_path: Path,
) -> None:
    """The app and a real worker (prefork, with beat) through PgBouncer in transaction mode;
    the pooler killed mid-load (every connection cut, commits in flight with outcomes their
    clients do not know) and started again on its port. Judged by the ledger: every refund
    the app saw committed is done exactly once, every state true; the time the app took to
    commit again is printed."""
    sim_control.create_order("acme", "A1042", 10**9)
    bouncer = PgBouncer(pg_url, "transaction")
    bouncer.start()
    url = bouncer.url + NO_PREPARE
    stack = Stack(
        database_url=url,
        broker_url=redis_url,
        downstream_url=simulator.url,
        api_keys={sim_tenant.name: sim_tenant.api_key.get_secret_value()},
        workdir=tmp_path,
    )
    engine = make_engine(url)
    app = App(stack, engine, outbox)
    producer = Producer(app, outbox)
    try:
        worker = stack.start_worker(beat=True, pool="prefork", concurrency=2)
        wait_until(
            lambda: "deadline fence verified" in stack.log_of(worker), 60, "the worker's start"
        )
        producer.start()
        wait_until(lambda: len(producer.committed) >= 15, 60, "the load before the restart")
        bouncer.kill()
        at_kill = producer.mark()
        wait_until(lambda: producer.failures > 0, 30, "a commit to fail on the cut pooler")
        bouncer.start()
        wait_until(
            lambda: len(producer.committed) >= at_kill + 15 or producer.error is not None,
            60,
            "the load after the restart",
        )
        producer.finish()
        ids = judge_committed(app, stack, producer, sim_control)
        assert "prepared statement" not in stack.logs()
        print(
            f"pgbouncer restarted under load: {len(ids)} refunds, {producer.failures} failed "
            f"commits, the app committing again {producer.recovered:.1f} s after the kill"
        )
    except BaseException:
        print(stack.logs())
        raise
    finally:
        producer.stopping.set()
        stack.stop_all()
        app.close()
        engine.dispose()
        bouncer.close()


@pytest.fixture
def engine(pg: Engine, pg_url: str) -> Iterator[Engine]:
    """The rig's engine: the test database through PgBouncer in transaction mode."""
    with pgbouncer(pg_url, "transaction") as url:
        bounced = make_engine(url + NO_PREPARE)
        yield bounced
        bounced.dispose()


@pytest.mark.parametrize("app_commits", [True, False], ids=["app-commits", "app-rolls-back"])
def test_the_approval_waits_for_the_apps_open_refund_through_transaction_pooling(
    rig: Rig, app_commits: bool
) -> None:
    """The advisory-lock path (``test_approval_races``) through PgBouncer in transaction mode:
    the lock is transaction-scoped, so it lives on the one server connection the transaction
    runs on, and the policy still waits for the app's open refund."""
    races.test_the_policy_waits_for_the_apps_open_refund_on_the_order_and_then_asks_a_person(
        rig, app_commits
    )
