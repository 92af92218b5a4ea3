"""The pure parts of intake on the app's connection (``outbox.borrowed``): which connections
are refused before anything is sent, and the server version read from libpq's number. On
in-memory sqlite3 connections: no server."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest

from outbox.errors import InvalidInput
from outbox.intake import Outbox
from outbox.kinds import default_registry
from outbox.settings import Settings
from outbox.storage import borrowed

GOOD = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}


@pytest.fixture
def outbox() -> Outbox:
    settings = Settings(
        fingerprint_keys={"v1": "test-fingerprint-key-0001"},  # type: ignore[dict-item]
        idempotency_secret="test-idempotency-secret",  # type: ignore[arg-type]
    )
    return Outbox.from_settings(settings, default_registry())


@pytest.fixture
def lite() -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(":memory:")
    yield conn
    conn.close()


class Autocommit(sqlite3.Connection):
    """A connection with Python 3.12's ``autocommit`` attribute (PEP 249 transaction
    control), whatever this interpreter's version."""

    autocommit: Any = True


@pytest.mark.parametrize(
    ("version", "expected"),
    [(150004, (15, 4)), (180000, (18, 0)), (100023, (10, 23)), (90624, (9, 6, 24))],
)
def test_the_server_version_from_libpqs_number(version: int, expected: tuple[int, ...]) -> None:
    assert borrowed._server_version(version) == expected


@pytest.mark.parametrize(
    ("isolation_level", "autocommit"),
    [(None, True), ("", False), ("DEFERRED", False), ("IMMEDIATE", False)],
)
def test_sqlite_legacy_autocommit_is_isolation_level_none(
    isolation_level: str | None, autocommit: bool
) -> None:
    conn = sqlite3.connect(":memory:", isolation_level=isolation_level)
    try:
        assert borrowed._sqlite_autocommit(conn) is autocommit
    finally:
        conn.close()


@pytest.mark.parametrize(("value", "autocommit"), [(True, True), (False, False)])
def test_sqlite_pep_249_autocommit_wins_over_isolation_level(value: bool, autocommit: bool) -> None:
    conn = sqlite3.connect(":memory:", factory=Autocommit)
    try:
        conn.autocommit = value
        conn.isolation_level = "" if value else None  # what Python 3.12 then ignores
        assert borrowed._sqlite_autocommit(conn) is autocommit
    finally:
        conn.close()


def code(outbox: Outbox, door: Any) -> str:
    with pytest.raises(InvalidInput) as info:
        outbox.enqueue(door, tenant="acme", op_id="op-9", kind="refund", params=GOOD)
    assert info.value.data == {"field": "connection"}
    return info.value.code


def test_an_sqlite_connection_in_autocommit_with_no_transaction_is_refused(outbox: Outbox) -> None:
    for conn in (
        sqlite3.connect(":memory:", isolation_level=None),
        sqlite3.connect(":memory:", factory=Autocommit),
    ):
        sent: list[str] = []
        conn.set_trace_callback(sent.append)
        assert (code(outbox, conn), sent) == ("no_transaction", [])
        conn.close()


def test_a_closed_sqlite_connection_is_refused_and_has_no_transaction(
    outbox: Outbox, lite: sqlite3.Connection
) -> None:
    lite.close()
    assert code(outbox, lite) == "connection_closed"
    assert borrowed.in_transaction(lite) is False


@pytest.mark.parametrize(
    "door", [object(), "sqlite://", 42, None], ids=["object", "url", "int", "none"]
)
def test_another_kind_of_connection_is_refused(outbox: Outbox, door: Any) -> None:
    assert code(outbox, door) == "unsupported_connection"


def test_the_refusals_say_what_to_do_and_carry_no_parameter(outbox: Outbox) -> None:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    with pytest.raises(InvalidInput) as info:
        outbox.enqueue(conn, tenant="acme", op_id="op-9", kind="refund", params=GOOD)
    conn.close()
    assert "begin one first" in info.value.message
    assert not any(str(value) in info.value.message for value in GOOD.values())


def test_reading_with_no_transaction_open_is_refused(lite: sqlite3.Connection) -> None:
    with pytest.raises(InvalidInput) as info:
        borrowed.read(lite, object, 1)
    assert info.value.code == "transaction_ended"
