"""Intake on an sqlite3 connection the app opened its own way: with ``detect_types`` and a
``datetime`` converter (as Django opens its connections), and with SQL functions of its own."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from sqlalchemy import Engine

from outbox.borrowed import session_for
from outbox.intake import Outbox
from outbox.runs import operation_status

GOOD = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}


@pytest.fixture
def parsing(sqlite: Engine) -> Iterator[sqlite3.Connection]:
    """The migrated SQLite file, opened as Django opens it: DATETIME columns come back as
    datetimes, parsed by the connection's converter, not as text."""
    previous = sqlite3.converters.get("DATETIME")
    sqlite3.register_converter("datetime", lambda raw: datetime.fromisoformat(raw.decode()))
    conn = sqlite3.connect(
        str(sqlite.url.database), detect_types=sqlite3.PARSE_DECLTYPES, isolation_level=None
    )
    try:
        yield conn
    finally:
        conn.close()
        if previous is None:
            sqlite3.converters.pop("DATETIME", None)
        else:
            sqlite3.converters["DATETIME"] = previous


def test_intake_reads_datetimes_the_connection_parsed_itself(
    parsing: sqlite3.Connection, outbox: Outbox
) -> None:
    parsing.execute("BEGIN")
    first = outbox.enqueue(parsing, tenant="acme", op_id="op-1", kind="refund", params=GOOD)
    again = outbox.enqueue(parsing, tenant="acme", op_id="op-1", kind="refund", params=GOOD)
    with session_for(parsing) as session:
        status = operation_status(session, "acme", "op-1")
    parsing.execute("COMMIT")
    assert (first.created, again.created, again.id) == (True, False, first.id)
    assert first.deadline.tzinfo is UTC
    assert again.deadline == first.deadline
    assert status["state"] == "planned"
    assert datetime.fromisoformat(status["created_at"]).tzinfo is not None


def test_intake_leaves_the_apps_sql_functions_as_they_are(sqlite: Engine, outbox: Outbox) -> None:
    conn = sqlite3.connect(str(sqlite.url.database), isolation_level=None)
    try:
        conn.create_function("regexp", 2, lambda pattern, value: 42)
        conn.execute("BEGIN")
        outbox.enqueue(conn, tenant="acme", op_id="op-1", kind="refund", params=GOOD)
        assert conn.execute("SELECT regexp('x', 1)").fetchone() == (42,)
        conn.execute("ROLLBACK")
    finally:
        conn.close()
