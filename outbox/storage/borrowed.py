"""Intake on a connection the app owns (its public names: ``outbox.borrowed``): a SQLAlchemy
``Connection`` (or, through ``AsyncConnection.run_sync``, an async one), or a DB-API
connection (psycopg 3, sqlite3) that the app, or its framework, opened and manages.

Settled's intake core (``outbox.intake``) writes through a SQLAlchemy ``Session``. These doors
give it one over the app's connection, inside the app's transaction, and take nothing over:

- ``session_on(connection)``: a ``Session`` joined to a SQLAlchemy ``Connection``'s
  transaction (begun if it was not, as the connection's own autobegin would); closing it
  neither commits nor rolls back.
- ``borrowed(dbapi_connection)``: a SQLAlchemy ``Connection`` over a DB-API connection that
  Settled never begins, commits, rolls back, closes or configures: its dialect's
  ``do_begin``, ``do_commit``, ``do_rollback`` and ``do_close`` do nothing; no notice handler,
  adapter or SQL function is added to it (the dialects' ``on_connect`` is empty); the
  dialect's first-connect initialisation sends no statement (what it would ask the server is
  read from what libpq already knows, or is SQLite's constant); and its cursors are made with
  tuple rows whatever row factory the app chose (psycopg's ``row_factory``, sqlite3's
  ``row_factory``), by the app's own ``cursor_factory`` unless that one takes ``$1``
  placeholders (``psycopg.RawCursor``), so its prepare threshold (``None`` behind PgBouncer)
  and any statement logging it does apply to Settled's statements too.
- ``session_for(door)``: a ``Session`` over any of them, for intake and the runs API.

Before anything is sent, a door is refused with a typed error (InvalidInput, nothing sent,
nothing written) when it cannot hold the app's transaction: ``connection_closed`` (closed or
broken), ``transaction_aborted`` (a psycopg transaction already in error: PostgreSQL would
refuse every statement until the app rolls back), ``no_transaction`` (autocommit with no
transaction open: the intent would commit on its own), ``unsupported_connection`` (another
kind of connection).

The ids of the operations a call created are the app's to hint after its commit
(``outbox.relay.publish_hints``): there is no commit event on a bare connection to hang the
relay on, and the ``Session`` these doors make never commits.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar, Union

import psycopg
from psycopg.pq import TransactionStatus
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
T = TypeVar("T")


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

    def on_connect(self) -> Any:  # None: no hook (SQLite's stub says a hook is always given)
        """Nothing added to the app's connection at each borrow (PostgreSQL: a notice
        handler; SQLite: the ``regexp`` and ``floor`` functions, which would replace the
        app's own)."""
        return None


def _server_version(version: int) -> tuple[int, ...]:
    """libpq's ``server_version`` number as SQLAlchemy's version tuple: 150004 is (15, 4),
    90624 is (9, 6, 24)."""
    if version >= 100000:
        return (version // 10000, version % 10000)
    return (version // 10000, version // 100 % 100, version % 100)


class BorrowedPsycopg(_Leaves, PGDialect_psycopg):
    """psycopg 3 on a connection the app owns.

    Its first-connect initialisation sends nothing: it would run in the app's transaction
    (``select version()``, ``show standard_conforming_strings``, ``select current_schema()``,
    ``show transaction isolation level``, the last followed by a rollback of the app's
    connection when no transaction was open yet). The server version and
    ``standard_conforming_strings`` are what libpq was told at connection start; the
    isolation level is PostgreSQL's default (the one SQLAlchemy would restore after an
    ``isolation_level`` execution option, which Settled never sets); the default schema is
    left unknown (reflection only)."""

    supports_statement_cache = True

    def _get_server_version_info(self, connection: Any) -> tuple[int, ...]:
        return _server_version(connection.connection.dbapi_connection.info.server_version)

    def _get_default_schema_name(self, connection: Any) -> str:
        raise NotImplementedError  # SQLAlchemy's initialize then leaves it None

    def get_default_isolation_level(self, dbapi_conn: Any) -> Any:
        return "READ COMMITTED"

    def _set_backslash_escapes(self, connection: Any) -> None:
        info = connection.connection.dbapi_connection.info
        self._backslash_escapes = info.parameter_status("standard_conforming_strings") == b"off"


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
    """sqlite3 on a connection the app owns; its first-connect initialisation sends nothing
    (SQLite's isolation is serializable; the library's version is the module's)."""

    supports_statement_cache = True
    colspecs = {**SQLiteDialect_pysqlite.colspecs, DateTime: _ParsedDateTime}  # noqa: RUF012

    def get_default_isolation_level(self, dbapi_conn: Any) -> Any:
        return "SERIALIZABLE"


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


def _refused(message: str, code: str) -> InvalidInput:
    return InvalidInput(message, code=code, field="connection")


def _no_transaction() -> InvalidInput:
    return _refused(
        "the connection is in autocommit mode with no transaction open: Settled writes "
        "in the app's transaction, so begin one first (psycopg: with conn.transaction(); "
        "sqlite3: BEGIN; SQLAlchemy: a connection that is not in AUTOCOMMIT)",
        "no_transaction",
    )


def _closed() -> InvalidInput:
    return _refused("the connection is closed or broken", "connection_closed")


def _aborted() -> InvalidInput:
    return _refused(
        "the connection's transaction has already failed (an earlier statement raised): "
        "PostgreSQL refuses every statement until it is rolled back, so nothing was sent; "
        "roll the transaction back and enqueue in a new one",
        "transaction_aborted",
    )


def _sqlite_autocommit(connection: sqlite3.Connection) -> bool:
    """Whether each statement on ``connection`` commits by itself when no transaction is
    open: Python 3.12's ``autocommit=True``, or the legacy ``isolation_level=None``. (The
    legacy default, ``isolation_level=""``, begins a transaction before a write, which
    intake's first statement always is.)"""
    autocommit = getattr(connection, "autocommit", None)  # Python 3.12+
    if autocommit is True or autocommit is False:
        return autocommit
    return connection.isolation_level is None


def _refuse_unusable(driver: object) -> None:
    """InvalidInput when the driver connection ``driver`` (psycopg's, sync or async, or
    sqlite3's) cannot hold the app's transaction; nothing is sent on it. Another driver is
    left to SQLAlchemy."""
    if isinstance(driver, psycopg.BaseConnection):
        status = driver.info.transaction_status
        if driver.closed or driver.broken or status == TransactionStatus.UNKNOWN:
            raise _closed()
        if status == TransactionStatus.INERROR:
            raise _aborted()
        if driver.autocommit and status == TransactionStatus.IDLE:
            raise _no_transaction()
    elif isinstance(driver, sqlite3.Connection):
        try:
            in_transaction = driver.in_transaction
        except sqlite3.ProgrammingError:  # "Cannot operate on a closed database."
            raise _closed() from None
        if not in_transaction and _sqlite_autocommit(driver):
            raise _no_transaction()


def _wrap(dbapi_connection: Any) -> tuple[str, Any]:
    """The dialect for ``dbapi_connection`` and the connection SQLAlchemy is given."""
    if isinstance(dbapi_connection, sqlite3.Connection):
        _refuse_unusable(dbapi_connection)

        def sqlite_cursor(*args: Any, **kwargs: Any) -> Any:
            cursor = dbapi_connection.cursor(*args, **kwargs)
            cursor.row_factory = None
            return cursor

        return "sqlite", _TupleRows(dbapi_connection, sqlite_cursor)
    if isinstance(dbapi_connection, psycopg.Connection):
        _refuse_unusable(dbapi_connection)
        # SQLAlchemy writes %(name)s placeholders: a RawCursor ($1, psycopg 3.2) cannot run
        # them, so Settled's statements get a plain cursor on such a connection.
        raw = getattr(psycopg, "RawCursor", None)
        plain = raw is not None and issubclass(dbapi_connection.cursor_factory, raw)

        def psycopg_cursor(*args: Any, **kwargs: Any) -> Any:
            kwargs["row_factory"] = tuple_row
            if plain and not args and "name" not in kwargs:
                return psycopg.Cursor(dbapi_connection, row_factory=tuple_row)
            return dbapi_connection.cursor(*args, **kwargs)

        return "postgresql", _TupleRows(dbapi_connection, psycopg_cursor)
    raise _refused(
        "intake takes a Session, a SQLAlchemy Connection, a psycopg (3) Connection or an "
        f"sqlite3 Connection, not a {type(dbapi_connection).__name__}",
        "unsupported_connection",
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

    Raises InvalidInput (``unsupported_connection``, ``connection_closed``,
    ``transaction_aborted``, ``no_transaction``) before anything is sent on it.
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
    the connection's, and closing it neither commits nor rolls back.

    Raises InvalidInput (``connection_closed``, ``transaction_aborted``, ``no_transaction``)
    before anything is sent; a transaction it began for that check is ended again."""
    if connection.closed or connection.invalidated:
        raise _closed()
    driver = connection.connection.driver_connection
    began = None
    if not connection.in_transaction():
        began = connection.begin()
    try:
        _refuse_unusable(driver)
    except InvalidInput:
        if began is not None:
            began.rollback()
        raise
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


def in_transaction(door: object) -> bool:
    """Whether a transaction is open on ``door``, a connection (a closed one has none)."""
    if isinstance(door, Connection):
        return not door.closed and door.in_transaction()
    if isinstance(door, sqlite3.Connection):
        try:
            return door.in_transaction
        except sqlite3.ProgrammingError:
            return False
    if isinstance(door, psycopg.Connection):
        return not door.closed and door.info.transaction_status == TransactionStatus.INTRANS
    return False


def read(door: object, model: type[T], ident: int) -> T | None:
    """Row ``ident`` of ``model``, read in the transaction open on ``door`` (a connection)
    and detached; None if it is not there.

    Raises InvalidInput (``transaction_ended``) when no transaction is open on ``door``:
    reading would begin one on the app's connection that nobody ends."""
    if not in_transaction(door):
        raise _refused(
            "the transaction this operation was enqueued in has ended, and Settled does not "
            "begin one on the app's connection: read the row in a transaction of the app's "
            "(outbox.borrowed.session_for(connection)), or use the values Enqueued carries",
            "transaction_ended",
        )
    with session_for(door) as session:  # type: ignore[arg-type]
        return session.get(model, ident)
