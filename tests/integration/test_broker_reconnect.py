"""The Redis transport after a broker crash: Celery's consumer can always tear its connection
down and connect again.

Celery's consumer, on losing the broker (``Consumer.on_connection_error_after_connected``), calls
``connection.collect()`` and then ``ignore_errors(connection, connection.close)``. ``collect``
closes the channels, but a close that needs the lost broker (draining a pending BRPOP, deleting
an auto-delete queue) raises part-way and leaves that channel open; ``collect`` then drops the
transport's client. With kombu's own channel, closing such a channel again (it still holds an
unacknowledged delivery to restore) raised ``AttributeError: 'NoneType' object has no attribute
'hostname'``: Celery's "Unrecoverable error", and the worker stopped consuming.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import suppress
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue
from kombu.common import ignore_errors

from settled.celery_app import RedisTransport
from tests.support.stack import RedisProcess

pytestmark = [pytest.mark.redis]


@pytest.fixture
def broker() -> Iterator[RedisProcess]:
    server = RedisProcess()
    server.start()
    yield server
    server.stop()


def consume_one_and_poll(conn: Connection) -> list[Any]:
    """Deliver one message (left unacknowledged) on the default channel, with a BRPOP pending
    there and an auto-delete fanout queue on a second channel, as a Celery worker has them
    (task consumer, remote-control mailbox)."""
    tasks = Queue("tasks", Exchange("tasks", type="direct"), routing_key="tasks")
    mailbox = Queue("mailbox", Exchange("mailbox", type="fanout"), auto_delete=True)
    with conn.Producer() as producer:
        producer.publish(
            {"ids": [1]}, exchange=tasks.exchange, routing_key="tasks", declare=[tasks]
        )
    received: list[Any] = []
    conn.Consumer([tasks], callbacks=[lambda _body, msg: received.append(msg)]).consume()
    conn.Consumer([mailbox], channel=conn.channel(), callbacks=[lambda *_: None]).consume()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (not received or not conn.default_channel._in_poll):
        with suppress(TimeoutError):
            conn.drain_events(timeout=0.2)  # leaves the next BRPOP pending
    assert len(received) == 1 and conn.default_channel._in_poll
    return received


def test_a_lost_connection_tears_down_with_connection_errors_only(broker: RedisProcess) -> None:
    conn = Connection(broker.url, transport=RedisTransport)
    try:
        consume_one_and_poll(conn)
        broker.stop()  # SIGKILL: every socket of the connection is reset
        # What Celery's consumer does on a connection error; before the fix, the close raised
        # AttributeError (not a connection error) out of ignore_errors.
        conn.collect(socket_timeout=1)
        ignore_errors(conn, conn.close)
    finally:
        conn.release()


def test_the_same_transport_consumes_again_after_the_broker_restarts(
    broker: RedisProcess,
) -> None:
    for restart in range(3):
        conn = Connection(broker.url, transport=RedisTransport)
        try:
            assert len(consume_one_and_poll(conn)) == 1, restart
            broker.stop()
            conn.collect(socket_timeout=1)
            ignore_errors(conn, conn.close)
        finally:
            conn.release()
        broker.start()  # empty: the next round publishes and consumes afresh
