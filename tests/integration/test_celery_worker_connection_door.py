"""Intents enqueued on the app's own psycopg connection (``outbox.borrowed``), settled by a real
Celery worker against PostgreSQL, Redis and the simulator: the app publishes the hints after
its commit (``outbox.relay.publish_hints``), and nothing else brings the operations to the
worker (no beat, so no sweeper)."""

from __future__ import annotations

import psycopg
import pytest
import redis
from sqlalchemy import Engine, make_url

from outbox.intake import Outbox
from outbox.relay import publish_hints
from settled.celery_app import hint_publisher
from settled.simulator import SimulatorControl
from tests.integration.test_celery_worker import (
    GOOD,
    App,
    app,
    assert_at_most_one_effect,
    broker_url,
    stack,
    wait_settled,
)
from tests.support.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]


def test_intents_enqueued_on_a_plain_psycopg_connection_are_sent_once_each(
    app: App,
    stack: Stack,
    pg: Engine,
    pg_url: str,
    outbox: Outbox,
    broker_url: str,
    sim_control: SimulatorControl,
    request: pytest.FixtureRequest,
) -> None:
    publish = hint_publisher(app.celery)  # the relay's (with the doorbell: at most 4 wait)
    client = redis.Redis.from_url(broker_url)
    request.addfinalizer(client.close)
    dsn = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    created: list[int] = []
    with psycopg.connect(dsn) as conn:  # the app's own connection, autocommit off
        for i in range(6):
            ids: list[int] = []
            with conn.transaction():
                got = outbox.enqueue(
                    conn,
                    tenant="acme",
                    op_id=f"op-conn-{i}",
                    kind="refund",
                    params={**GOOD, "amount_minor": 100 + i},
                )
                ids.append(got.id)
                if i % 2:  # a replay in the same transaction: the same operation, no new id
                    again = outbox.enqueue(
                        conn,
                        tenant="acme",
                        op_id=f"op-conn-{i}",
                        kind="refund",
                        params={**GOOD, "amount_minor": 100 + i},
                    )
                    assert (again.created, again.id) == (False, got.id)
                if i == 0:
                    assert client.llen("settled") == 0  # Settled publishes nothing itself
            publish_hints(publish, ids)  # after the commit, by the app
            created += ids
        with conn.transaction():
            rolled_back = outbox.enqueue(
                conn, tenant="acme", op_id="op-conn-gone", kind="refund", params=GOOD
            )
            raise psycopg.Rollback()  # nothing to hint: the intent went with the transaction
    assert client.llen("settled") >= 1  # the app's hints wait for the worker
    stack.start_worker(pool="prefork", concurrency=2, beat=False)
    assert set(wait_settled(app, stack, created).values()) == {"succeeded"}
    assert assert_at_most_one_effect(app, sim_control, created) == [1] * 6
    assert app.states([rolled_back.id]) == {}


_FIXTURES = (app, broker_url, stack)  # the real worker's, from tests.integration.test_celery_worker
