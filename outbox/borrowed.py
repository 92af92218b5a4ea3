"""Intake on a connection the app owns: a SQLAlchemy ``Connection``, or a DB-API connection
(psycopg 3, sqlite3) that the app, or its framework (Django), opened and manages.

Settled's intake core (``outbox.intake``) writes through a SQLAlchemy ``Session``. These doors
give it one over the app's connection, inside the app's transaction, and take nothing over:

- ``session_on(connection)``: a ``Session`` joined to a SQLAlchemy ``Connection``'s
  transaction (begun if it was not); closing it neither commits nor rolls back.
- ``borrowed(dbapi_connection)``: a SQLAlchemy ``Connection`` over a DB-API connection that
  Settled never begins, commits, rolls back, closes or configures: its dialect's
  ``do_begin``, ``do_commit``, ``do_rollback`` and ``do_close`` do nothing, no handler or
  adapter is added to it (nor an SQL function: the app's ``regexp()`` stays the app's), and
  its cursors are made with tuple rows whatever row factory the app chose (psycopg's
  ``row_factory``, sqlite3's ``row_factory``); DATETIME columns that an sqlite3 connection
  parses itself (``detect_types``, as Django's do) are taken as parsed.

The ids of the operations a call created are the app's to hint after its commit
(``outbox.relay.publish_hints``, or ``transaction.on_commit`` in Django): there is no commit
event on a bare connection to hang the relay on.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Union

import psycopg
from psycopg.rows import tuple_row
from sqlalchemy import Connection, DateTime, Engine, create_engine
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.dialects.sqlite import DATETIME as SQLITE_DATETIME
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox.errors import InvalidInput

#: Where intake can write: the app's ``Session`` or ``Connection``, or its own DB-API
#: connection (psycopg 3, sqlite3) with a transaction open or to be opened by the statement.
Door = Union[Session, Connection, "psycopg.Connection[Any]", sqlite3.Connection]


class _Leaves:
    """A dialect that leaves the DB-API connection's transaction and life to its owner."""

    def do_begin(self, dbapi_connection: Any) -> None:
        pass

    def do_commit(self, dbapi_connection: Any) -> None:
        pass

    def do_rollback(self, dbapi_connection: Any) -> None:
        pass

    def do_close(self, dbapi_connection: Any) -> None:
        pass

    def do_terminate(self, dbapi_connection: Any) -> None:
        pass


class BorrowedPsycopg(_Leaves, PGDialect_psycopg):
    """psycopg 3 on a connection the app owns."""

    supports_statement_cache = True

    def on_connect(self) -> Callable[[Any], None] | None:  # no notice handler added per use
        return None


class _ParsedDateTime(SQLITE_DATETIME):
    """SQLite's DATETIME, read from a connection that may parse it itself: one opened with
    ``detect_types`` and a ``datetime`` converter (Django's) returns datetimes, not text."""

    def result_processor(self, dialect: Any, coltype: object) -> Callable[[Any], Any] | None:
        parse = super().result_processor(dialect, coltype)
        if parse is None:  # pragma: no cover - SQLite's DATETIME always parses text
            return None

        def process(value: Any) -> Any:
            return value if isinstance(value, datetime) else parse(value)

        return process


class BorrowedSQLite(_Leaves, SQLiteDialect_pysqlite):
    """sqlite3 on a connection the app owns."""

    supports_statement_cache = True
    colspecs = {**SQLiteDialect_pysqlite.colspecs, DateTime: _ParsedDateTime}  # noqa: RUF012

    def on_connect(self) -> Callable[[Any], None]:
        # SQLAlchemy's would register its own regexp() and floor() on the app's connection
        # at every use, replacing the app's (Django registers a regexp() of its own).
        return _leave_as_it_is


def _leave_as_it_is(dbapi_connection: Any) -> None:
    pass


class _TupleRows:
    """The app's DB-API connection, with cursors that return tuples (SQLAlchemy reads rows by
    position) and the rest of its attributes as they are."""

    def __init__(self, connection: Any, cursor: Any) -> None:
        self._connection = connection
        self._cursor = cursor

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        return self._cursor(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)


def _no_transaction() -> InvalidInput:
    return InvalidInput(
        "the connection is in autocommit mode with no transaction open: Settled writes "
        "in the app's transaction, so begin one first (psycopg: with conn.transaction(); "
        "sqlite3: BEGIN)",
        code="no_transaction",
        field="connection",
    )


def _wrap(dbapi_connection: Any) -> tuple[str, Any]:
    """The dialect for ``dbapi_connection`` and the connection SQLAlchemy is given."""
    if isinstance(dbapi_connection, sqlite3.Connection):
        if dbapi_connection.isolation_level is None and not dbapi_connection.in_transaction:
            raise _no_transaction()

        def sqlite_cursor(*args: Any, **kwargs: Any) -> Any:
            cursor = dbapi_connection.cursor(*args, **kwargs)
            cursor.row_factory = None
            return cursor

        return "sqlite", _TupleRows(dbapi_connection, sqlite_cursor)
    if isinstance(dbapi_connection, psycopg.Connection):
        status = dbapi_connection.info.transaction_status
        if dbapi_connection.autocommit and status == psycopg.pq.TransactionStatus.IDLE:
            raise _no_transaction()

        def psycopg_cursor(*args: Any, **kwargs: Any) -> Any:
            kwargs["row_factory"] = tuple_row
            return dbapi_connection.cursor(*args, **kwargs)

        return "postgresql", _TupleRows(dbapi_connection, psycopg_cursor)
    raise InvalidInput(
        "intake takes a psycopg (3) Connection or an sqlite3 Connection, "
        f"not a {type(dbapi_connection).__name__}",
        code="unsupported_connection",
        field="connection",
    )


registry.register("postgresql.settled_borrowed", __name__, "BorrowedPsycopg")
registry.register("sqlite.settled_borrowed", __name__, "BorrowedSQLite")
_URLS = {"postgresql": "postgresql+settled_borrowed://", "sqlite": "sqlite+settled_borrowed://"}
_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()
_lent = threading.local()


def _lent_connection() -> Any:
    got = getattr(_lent, "connection", None)
    if got is None:  # pragma: no cover - only ``borrowed`` connects
        raise RuntimeError("no connection is lent to this thread")
    return got


def _engine(name: str) -> Engine:
    """One engine per database kind, whose pool hands out the connection lent to the
    thread at the moment (``borrowed``) and keeps none."""
    with _engines_lock:
        engine = _engines.get(name)
        if engine is None:
            engine = create_engine(
                _URLS[name],
                creator=_lent_connection,
                poolclass=NullPool,
                hide_parameters=True,
                **({"use_native_hstore": False} if name == "postgresql" else {}),
            )
            _engines[name] = engine
        return engine


@contextmanager
def borrowed(dbapi_connection: Any) -> Iterator[Connection]:
    """A SQLAlchemy ``Connection`` writing on ``dbapi_connection`` in whatever transaction
    the app has open on it; leaving it changes nothing about that transaction.

    Raises InvalidInput (``unsupported_connection``) for a connection of another kind, before
    anything is sent on it.
    """
    name, wrapped = _wrap(dbapi_connection)
    engine = _engine(name)
    before = getattr(_lent, "connection", None)
    _lent.connection = wrapped
    try:
        with engine.connect() as connection:
            _lent.connection = before
            yield connection
    finally:
        _lent.connection = before


@contextmanager
def session_on(connection: Connection) -> Iterator[Session]:
    """A ``Session`` in ``connection``'s transaction (begun if none is): its statements are
    the connection's, and closing it neither commits nor rolls back."""
    if not connection.in_transaction():
        connection.begin()
    session = Session(bind=connection, join_transaction_mode="rollback_only")
    try:
        yield session
    finally:
        session.close()


@contextmanager
def session_for(target: Door) -> Iterator[Session]:
    """A ``Session`` in ``target``'s transaction: ``target`` itself if it is one; else one
    over the SQLAlchemy ``Connection`` (``session_on``) or over the app's DB-API connection
    (``borrowed``). Whatever the door, nothing is committed, rolled back or closed that the
    app opened."""
    if isinstance(target, Session):
        yield target
    elif isinstance(target, Connection):
        with session_on(target) as session:
            yield session
    else:
        with borrowed(target) as connection, session_on(connection) as session:
            yield session
