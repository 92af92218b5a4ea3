"""Intake on a connection the app owns (``outbox.borrowed``), against real PostgreSQL and an
SQLite file: a SQLAlchemy ``Connection``, an ``AsyncConnection``, the app's psycopg 3
connection and its sqlite3 connection.

What goes wrong on a connection Settled does not own, each tried here: the app's row factory
and cursor factory, a prepare threshold of None (PgBouncer), a transaction already in error, a
closed connection, autocommit with no transaction, threads borrowing at once, many borrows on
one connection, the dialect's first connect, ``Enqueued.operation`` after the transaction,
savepoints, and the statements sent (read off the wire: libpq's trace, sqlite3's trace
callback)."""

from __future__ import annotations

import asyncio
import gc
import sqlite3
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.pq import Trace, TransactionStatus
from psycopg.rows import dict_row, namedtuple_row
from sqlalchemy import (
    Column,
    Connection,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    event,
    func,
    make_url,
    select,
    text,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine
from sqlalchemy.orm import Session

from outbox import relay, runs
from outbox.aio import AsyncOutbox
from outbox.errors import (
    IdempotencyConflict,
    InvalidIdentifier,
    InvalidInput,
    InvalidParams,
    NotFound,
)
from outbox.intake import Outbox
from outbox.models import Operation, OperationEvent
from outbox.storage import borrowed
from tests.conftest import truncate
from tests.support.pgbouncer import pgbouncer

GOOD = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}

business = MetaData()
refund_requests = Table(
    "refund_requests_conn",
    business,
    Column("id", Integer, primary_key=True),
    Column("order_id", String(64)),
)
INSERT_PG = "INSERT INTO refund_requests_conn (order_id) VALUES (%s)"
INSERT_SQLITE = "INSERT INTO refund_requests_conn (order_id) VALUES (?)"


def enqueue(outbox: Outbox, door: Any, **kw: Any) -> Any:
    args: dict[str, Any] = {"tenant": "acme", "op_id": "op-9", "kind": "refund", "params": GOOD}
    args.update(kw)
    return outbox.enqueue(door, **args)


def count(engine: Engine, table: Any = Operation) -> int:
    with Session(engine) as s:
        return int(s.scalar(select(func.count()).select_from(table)) or 0)


def stored(engine: Engine) -> tuple[int, int, int]:
    """(operations, their events, business rows)."""
    return count(engine), count(engine, OperationEvent), count(engine, refund_requests)


@pytest.fixture
def libpq(pg: Engine, pg_url: str) -> Iterator[str]:
    """The test database's libpq URL, with the business table; emptied after the test."""
    business.create_all(pg)
    try:
        yield make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    finally:
        business.drop_all(pg)


@pytest.fixture
def connect(libpq: str) -> Iterator[Callable[..., psycopg.Connection[Any]]]:
    """Opens the app's psycopg connections (with the given options); closes them after."""
    opened: list[psycopg.Connection[Any]] = []

    def open_one(**kw: Any) -> psycopg.Connection[Any]:
        conn = psycopg.connect(libpq, **kw)
        opened.append(conn)
        return conn

    yield open_one
    for conn in opened:
        conn.close()


@pytest.fixture
def sqlite_file(sqlite: Engine) -> Path:
    """A migrated SQLite file with the business table."""
    business.create_all(sqlite)
    assert sqlite.url.database
    return Path(sqlite.url.database)


@contextmanager
def wire(conn: psycopg.Connection[Any]) -> Iterator[list[str]]:
    """The statements ``conn`` sent to the server meanwhile (libpq's trace: one per Query
    message of the simple protocol, one per Execute of the extended one), by first word."""
    sent: list[str] = []
    with tempfile.TemporaryFile() as trace:
        conn.pgconn.trace(trace.fileno())
        conn.pgconn.set_trace_flags(Trace.SUPPRESS_TIMESTAMPS | Trace.REGRESS_MODE)
        try:
            yield sent
        finally:
            conn.pgconn.untrace()
            trace.seek(0)
            parsed = ""
            for line in trace.read().decode().splitlines():
                if not line.startswith("F\t"):  # the server's, or a statement's next line
                    continue
                _, _, message, *rest = line.split("\t")
                body = rest[0].strip() if rest else ""
                if message == "Query":
                    sent.append(body.strip('"').split(None, 1)[0].upper())
                elif message == "Parse":
                    parsed = body.split('"')[3].split(None, 1)[0].upper()
                elif message == "Execute":
                    sent.append(parsed or "PREPARED")


# -- the contract, on each connection door ----------------------------------------------


class App:
    """The app's connection of one kind, and the engine that reads what it committed."""

    def __init__(self, door: Any, engine: Engine) -> None:
        self.door = door
        self.engine = engine

    def insert(self, order: str) -> None:
        """The app's business row, in its transaction."""
        if isinstance(self.door, Connection):
            self.door.execute(refund_requests.insert(), {"order_id": order})
        elif isinstance(self.door, sqlite3.Connection):
            self.door.execute(INSERT_SQLITE, [order])
        else:
            self.door.execute(INSERT_PG, [order])

    def commit(self) -> None:
        self.door.commit()

    def rollback(self) -> None:
        self.door.rollback()


@pytest.fixture(params=["psycopg", "sqlite3", "sqlalchemy-postgresql", "sqlalchemy-sqlite"])
def app(request: pytest.FixtureRequest) -> Iterator[App]:
    name = request.param
    on_pg = name in ("psycopg", "sqlalchemy-postgresql")
    request.getfixturevalue("libpq" if on_pg else "sqlite_file")  # the business table
    engine: Engine = request.getfixturevalue("pg" if on_pg else "sqlite")
    if name == "psycopg":
        yield App(request.getfixturevalue("connect")(), engine)
    elif name == "sqlite3":
        assert engine.url.database
        lite = sqlite3.connect(engine.url.database)  # the default: BEGIN before a write
        try:
            yield App(lite, engine)
        finally:
            lite.close()
    else:
        with engine.connect() as sa:
            yield App(sa, engine)


def test_the_intent_commits_with_the_business_row_and_nothing_before(
    app: App, outbox: Outbox
) -> None:
    app.insert("A1042")
    got = enqueue(outbox, app.door, correlation_id="call-1")
    assert got.created and (got.tenant, got.op_id, got.state) == ("acme", "op-9", "planned")
    assert borrowed.in_transaction(app.door)  # left open: the app's to end
    assert stored(app.engine) == (0, 0, 0)  # nothing visible before the app commits
    app.commit()
    assert stored(app.engine) == (1, 1, 1)
    with Session(app.engine) as s:
        op = s.get(Operation, got.id)
        assert op is not None and (op.params, op.correlation_id) == (GOOD, "call-1")


def test_a_rollback_leaves_neither_the_business_row_nor_the_intent(
    app: App, outbox: Outbox
) -> None:
    app.insert("A1042")
    enqueue(outbox, app.door)
    app.rollback()
    assert stored(app.engine) == (0, 0, 0)


def test_replay_and_conflict(app: App, outbox: Outbox) -> None:
    first = enqueue(outbox, app.door)
    app.commit()
    again = enqueue(outbox, app.door, params=dict(reversed(list(GOOD.items()))))
    assert (again.created, again.id, again.idempotency_key) == (
        False,
        first.id,
        first.idempotency_key,
    )
    assert again.operation.params == GOOD  # a replay's row: the one intake read
    with pytest.raises(IdempotencyConflict):
        enqueue(outbox, app.door, params={**GOOD, "amount_minor": 1})
    app.rollback()
    assert count(app.engine) == 1
    with Session(app.engine) as s:
        assert s.scalars(select(Operation.params)).one() == GOOD  # the stored one untouched


@pytest.mark.parametrize(
    ("bad", "error", "code"),
    [
        ({"op_id": "has space"}, InvalidIdentifier, "invalid_op_id"),
        ({"tenant": ""}, InvalidIdentifier, "invalid_tenant"),
        ({"params": {**GOOD, "amount_minor": -1}}, InvalidParams, "invalid_params"),
        ({"max_attempts": 0}, InvalidInput, "invalid_budget"),
    ],
)
def test_bad_input_is_a_typed_error_and_the_app_transaction_goes_on(
    app: App, outbox: Outbox, bad: dict[str, Any], error: type[Exception], code: str
) -> None:
    app.insert("A1042")
    with pytest.raises(error) as info:
        enqueue(outbox, app.door, **bad)
    assert getattr(info.value, "code", None) == code
    app.insert("A1043")  # the app's transaction is still usable
    app.commit()
    assert stored(app.engine) == (0, 0, 2)


def test_the_hint_is_the_apps_to_publish_after_its_commit(app: App, outbox: Outbox) -> None:
    """No Session commits on a connection door, so no relay (even one on the Session class)
    publishes; the app publishes the ids it created once its commit returned."""
    commits: list[Session] = []

    def heard(session: Session) -> None:
        commits.append(session)

    event.listen(Session, "after_commit", heard)
    try:
        got = enqueue(outbox, app.door)
        app.commit()
    finally:
        event.remove(Session, "after_commit", heard)
    assert commits == []
    published: list[list[int]] = []
    assert relay.publish_hints(lambda ids: published.append(list(ids)), [got.id]) == 1
    assert published == [[got.id]]


def test_enqueued_operation_reads_in_the_open_transaction_then_is_refused(
    app: App, outbox: Outbox
) -> None:
    got = enqueue(outbox, app.door)
    late = enqueue(outbox, app.door, op_id="op-10")
    assert got.operation.id == got.id and got.operation.state == "planned"  # read, detached
    app.commit()
    assert got.operation.op_id == "op-9"  # read once: kept
    with pytest.raises(InvalidInput) as info:
        late.operation  # noqa: B018
    assert info.value.code == "transaction_ended"
    assert not borrowed.in_transaction(app.door)  # and no transaction was begun to read it


def test_after_a_rollback_the_operation_is_not_found(app: App, outbox: Outbox) -> None:
    got = enqueue(outbox, app.door)
    app.rollback()
    app.insert("A1042")  # a new transaction on the same connection
    with pytest.raises(NotFound):
        got.operation  # noqa: B018
    app.rollback()


def test_a_run_through_session_for(app: App, outbox: Outbox) -> None:
    """The runs API on a connection door: ``session_for`` gives it a Session in the app's
    transaction."""
    with borrowed.session_for(app.door) as s:
        run = runs.open_run(s, tenant="acme", title="After-sales for A1042")
        handle = run.handle
    got = enqueue(outbox, app.door, run=run)
    app.commit()
    with borrowed.session_for(app.door) as s:
        report = runs.run_report(s, "acme", handle)
    app.rollback()
    assert got.run_id == run.id and report.line(got.op_id).message == "planned"


def test_an_unsupported_connection_is_a_typed_error(libpq: str, outbox: Outbox) -> None:
    async def make() -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(libpq)

    other = asyncio.run(make())  # psycopg's async connection: the async door takes SQLAlchemy's
    try:
        for door in (object(), "postgresql://", other):
            with pytest.raises(InvalidInput) as info:
                enqueue(outbox, door)
            assert (info.value.code, info.value.data) == (
                "unsupported_connection",
                {"field": "connection"},
            )
    finally:
        asyncio.run(other.close())


# -- psycopg: the app's connection as the app configured it ------------------------------


@pytest.mark.parametrize("rows", [dict_row, namedtuple_row], ids=["dict_row", "namedtuple_row"])
@pytest.mark.parametrize(
    "cursors", [psycopg.Cursor, psycopg.ClientCursor, psycopg.RawCursor], ids=lambda c: c.__name__
)
def test_any_row_and_cursor_factory(
    connect: Callable[..., psycopg.Connection[Any]],
    pg: Engine,
    outbox: Outbox,
    rows: Any,
    cursors: type[psycopg.Cursor[Any]],
) -> None:
    conn = connect(row_factory=rows, cursor_factory=cursors)
    first = enqueue(outbox, conn)
    again = enqueue(outbox, conn)
    assert (first.created, again.created, again.id) == (True, False, first.id)
    assert isinstance(first.deadline.year, int) and again.operation.op_id == "op-9"
    with pytest.raises(IdempotencyConflict):
        enqueue(outbox, conn, params={**GOOD, "payee": "P-8"})
    conn.rollback()
    # The app's own cursors are as it made them.
    cur = conn.cursor()
    assert type(cur) is cursors and cur.row_factory is rows
    row = conn.execute("SELECT 1 AS one").fetchone()
    assert (row["one"] if rows is dict_row else row.one) == 1
    assert count(pg) == 0


def test_a_client_cursor_factory_carries_settleds_statements_too(
    connect: Callable[..., psycopg.Connection[Any]], outbox: Outbox
) -> None:
    """The app's cursor factory makes Settled's cursors: client-side binding (one Query
    message, no Parse), and a subclass that logs statements sees them."""
    seen: list[str] = []

    class Logged(psycopg.ClientCursor[Any]):
        def execute(self, query: Any, params: Any = None, **kw: Any) -> Any:
            seen.append(str(query).split(None, 1)[0])
            return super().execute(query, params, **kw)

    conn = connect(cursor_factory=Logged)
    enqueue(outbox, conn, op_id="op-warm")
    with wire(conn) as sent:
        enqueue(outbox, conn)
    assert sent == ["WITH"] and seen == ["WITH", "WITH"]
    conn.rollback()


def test_prepare_threshold_none_prepares_nothing_on_the_server(
    connect: Callable[..., psycopg.Connection[Any]], outbox: Outbox
) -> None:
    """PgBouncer in transaction mode (before 1.21): the app's ``prepare_threshold=None`` holds
    for Settled's statements; with the threshold at 0 the same calls prepare (the check can
    see them)."""
    prepared = "SELECT statement FROM pg_prepared_statements"
    found = {}
    for threshold in (None, 0):
        conn = connect(prepare_threshold=threshold)
        enqueue(outbox, conn)
        for _ in range(8):
            enqueue(outbox, conn)  # replays: the INSERT and the SELECT, again and again
        found[threshold] = {row[0].split(None, 1)[0] for row in conn.execute(prepared)}
        conn.rollback()
    assert found == {None: set(), 0: {"WITH", "SELECT"}}


def test_through_pgbouncer_in_transaction_mode_the_apps_prepare_threshold_holds(
    pg: Engine, pg_url: str, outbox: Outbox
) -> None:
    """Two app connections through PgBouncer (1.18) in transaction mode over one server
    connection: with psycopg's default threshold Settled's statements, prepared after five
    runs, collide there; with ``prepare_threshold=None`` every intake goes through."""
    with pgbouncer(pg_url, "transaction", pool_size=1) as bounced:
        dsn = make_url(bounced).set(drivername="postgresql").render_as_string(hide_password=False)

        def intakes(**options: Any) -> None:
            conns = [psycopg.connect(dsn, **options) for _ in range(2)]
            try:
                for n in range(8):
                    for i, conn in enumerate(conns):
                        enqueue(outbox, conn, op_id=f"c{i}-{n % 2}")  # new, then replays
                        conn.commit()
            finally:
                for conn in conns:
                    conn.close()

        with pytest.raises(DBAPIError) as failed:
            intakes()
        assert isinstance(
            failed.value.orig,
            psycopg.errors.DuplicatePreparedStatement | psycopg.errors.InvalidSqlStatementName,
        )
        truncate(pg)
        intakes(prepare_threshold=None)
    assert count(pg) == 4  # c0-0, c0-1, c1-0, c1-1


def test_a_new_intent_is_one_statement_a_replay_two(
    connect: Callable[..., psycopg.Connection[Any]], outbox: Outbox
) -> None:
    conn = connect()
    enqueue(outbox, conn, op_id="op-warm")  # SQLAlchemy compiles each statement once
    conn.commit()
    seen = []
    for _ in range(2):
        conn.execute(INSERT_PG, ["A1042"])  # the app's transaction has begun
        with wire(conn) as sent:
            enqueue(outbox, conn)
        conn.commit()
        seen.append(sent)
    new, replay = seen
    assert (new, replay) == (["WITH"], ["WITH", "SELECT"])


def test_the_first_borrow_of_a_process_sends_only_the_intake_statement(
    connect: Callable[..., psycopg.Connection[Any]],
    pg: Engine,
    outbox: Outbox,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dialect's first-connect initialisation runs in the app's transaction: it sends
    nothing (what it would ask is what libpq already knows), so it cannot break that
    transaction, and it learns what SQLAlchemy's own initialisation learns."""
    monkeypatch.setattr(borrowed, "_engines", {})  # a process that never borrowed
    conn = connect()
    conn.execute(INSERT_PG, ["A1042"])
    with wire(conn) as sent:
        got = enqueue(outbox, conn)
    assert sent == ["WITH"] and conn.info.transaction_status == TransactionStatus.INTRANS
    conn.commit()
    assert got.created and stored(pg) == (1, 1, 1)
    ours = borrowed._engines["postgresql"].dialect
    theirs = create_engine(pg.url)
    with theirs.connect():
        pass
    names = (
        "server_version_info",
        "_backslash_escapes",
        "supports_smallserial",
        "supports_identity_columns",
        "_supports_jsonb_subscripting",
        "insert_returning",
        "insert_executemany_returning",
        "default_isolation_level",
    )
    assert {n: getattr(ours, n) for n in names} == {n: getattr(theirs.dialect, n) for n in names}
    theirs.dispose()


def test_a_transaction_already_in_error_is_refused_and_nothing_is_sent(
    connect: Callable[..., psycopg.Connection[Any]], pg: Engine, outbox: Outbox
) -> None:
    conn = connect()
    with pytest.raises(psycopg.errors.DivisionByZero):
        conn.execute("SELECT 1/0")
    with wire(conn) as sent, pytest.raises(InvalidInput) as info:
        enqueue(outbox, conn)
    assert (info.value.code, sent) == ("transaction_aborted", [])
    conn.rollback()
    assert enqueue(outbox, conn).created  # the next transaction takes it
    conn.commit()
    assert count(pg) == 1


def test_autocommit_without_a_transaction_is_refused_and_nothing_is_sent(
    connect: Callable[..., psycopg.Connection[Any]], pg: Engine, outbox: Outbox
) -> None:
    conn = connect(autocommit=True)
    with wire(conn) as sent, pytest.raises(InvalidInput) as info:
        enqueue(outbox, conn)
    assert (info.value.code, sent) == ("no_transaction", [])
    with conn.transaction():  # in a transaction block, autocommit is no obstacle
        enqueue(outbox, conn)
    assert count(pg) == 1


def test_a_closed_connection_is_refused(
    connect: Callable[..., psycopg.Connection[Any]], outbox: Outbox
) -> None:
    conn = connect()
    conn.close()
    with pytest.raises(InvalidInput) as info:
        enqueue(outbox, conn)
    assert info.value.code == "connection_closed"


def test_a_savepoint_rolled_back_takes_its_intent_and_keeps_the_rest(
    connect: Callable[..., psycopg.Connection[Any]], pg: Engine, outbox: Outbox
) -> None:
    conn = connect(autocommit=True)
    with conn.transaction():
        conn.execute(INSERT_PG, ["A1042"])
        with conn.transaction():  # a savepoint
            enqueue(outbox, conn, op_id="op-dropped")
            raise psycopg.Rollback()
        with conn.transaction():
            kept = enqueue(outbox, conn, op_id="op-kept")
    assert stored(pg) == (1, 1, 1)
    with Session(pg) as s:
        assert s.scalars(select(Operation.id)).one() == kept.id


def test_two_threads_borrowing_at_once_write_each_on_its_own_connection(
    connect: Callable[..., psycopg.Connection[Any]],
    pg: Engine,
    outbox: Outbox,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The borrowed engine's pool asks its creator for "the connection lent to this thread":
    two threads inside it at once (each has lent its connection before either asks, and
    neither goes on before both asked) still get their own. Each thread's intents are then in
    its connection's transaction: visible there before its commit, and gone with its
    rollback."""
    monkeypatch.setattr(borrowed, "_engines", {})  # an engine made with the creator below
    lent = borrowed._lent_connection
    inside, asked = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]
    which = threading.local()

    def creator() -> Any:
        inside[which.i].set()
        assert inside[1 - which.i].wait(timeout=60)
        got = lent()
        asked[which.i].set()
        assert asked[1 - which.i].wait(timeout=60)
        return got

    monkeypatch.setattr(borrowed, "_lent_connection", creator)
    rounds = 20
    conns = [connect(), connect()]

    def work(i: int) -> None:
        which.i = i
        conn = conns[i]
        for n in range(rounds):
            got = enqueue(outbox, conn, op_id=f"t{i}-{n}", params={**GOOD, "order_id": f"O{i}"})
            seen = conn.execute("SELECT id FROM operations WHERE op_id = %s", [got.op_id])
            assert seen.fetchall() == [(got.id,)]
        (conn.commit if i == 0 else conn.rollback)()

    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(work, i) for i in (0, 1)]:
            done.result()
    with Session(pg) as s:
        kept = set(s.scalars(select(Operation.op_id)))
    assert kept == {f"t0-{n}" for n in range(rounds)}


def test_a_thousand_borrows_add_nothing_to_the_connection_and_keep_nothing(
    connect: Callable[..., psycopg.Connection[Any]], outbox: Outbox
) -> None:
    conn = connect()
    enqueue(outbox, conn)

    def adapters() -> tuple[Any, ...]:  # psycopg's AdaptersMap, read: it lists nothing
        a = conn.adapters
        return (
            {fmt: dict(by_type) for fmt, by_type in a._dumpers.items()},
            [dict(by_oid) for by_oid in a._dumpers_by_oid],
            [dict(by_oid) for by_oid in a._loaders],
        )

    handlers, before, engines = list(conn._notice_handlers), adapters(), dict(borrowed._engines)
    gc.collect()
    references = sys.getrefcount(conn)
    for _ in range(1000):
        enqueue(outbox, conn)
    gc.collect()
    assert sys.getrefcount(conn) == references  # nothing holds the app's connection
    assert conn._notice_handlers == handlers and adapters() == before
    assert borrowed._engines == engines
    conn.rollback()


def test_nothing_done_through_settleds_objects_ends_the_apps_transaction(
    connect: Callable[..., psycopg.Connection[Any]], pg: Engine, outbox: Outbox
) -> None:
    """A commit or close on the borrowed SQLAlchemy connection, or a commit of the Session
    ``session_for`` gives, reaches nothing: the app's connection stays open, in its
    transaction, and its rollback takes everything."""
    conn = connect()
    conn.execute(INSERT_PG, ["A1042"])
    with borrowed.borrowed(conn) as sa:
        enqueue(outbox, sa, op_id="op-1")
        sa.commit()
        sa.close()
    with borrowed.session_for(conn) as s:
        enqueue(outbox, s, op_id="op-2")
        s.commit()
    assert not conn.closed and conn.info.transaction_status == TransactionStatus.INTRANS
    conn.rollback()
    assert stored(pg) == (0, 0, 0)


def test_the_app_can_still_roll_back_after_settled_failed_mid_transaction(
    connect: Callable[..., psycopg.Connection[Any]], pg: Engine, outbox: Outbox
) -> None:
    """A conflict raised after intake's statements ran leaves the app's transaction to the
    app: still open, its business row in it, committed or rolled back as the app says."""
    conn = connect()
    enqueue(outbox, conn)
    conn.commit()
    conn.execute(INSERT_PG, ["A1042"])
    with pytest.raises(IdempotencyConflict):
        enqueue(outbox, conn, params={**GOOD, "amount_minor": 1})
    assert conn.info.transaction_status == TransactionStatus.INTRANS
    conn.commit()
    assert stored(pg) == (1, 1, 1)


# -- sqlite3 ------------------------------------------------------------------------------


def test_sqlite_rows_and_the_apps_own_functions(
    sqlite_file: Path, sqlite: Engine, outbox: Outbox
) -> None:
    lite = sqlite3.connect(sqlite_file)
    try:
        lite.row_factory = sqlite3.Row
        lite.create_function("floor", 1, lambda x: "the app's floor")
        lite.create_function("regexp", 2, lambda a, b: 7)
        first = enqueue(outbox, lite)
        again = enqueue(outbox, lite)
        assert (first.created, again.created, again.operation.op_id) == (True, False, "op-9")
        row = lite.execute("SELECT floor(1.5) AS f, 'a' REGEXP 'b' AS r").fetchone()
        assert isinstance(row, sqlite3.Row) and (row["f"], row["r"]) == ("the app's floor", 7)
        lite.commit()
    finally:
        lite.close()
    assert count(sqlite) == 1


def test_sqlite_a_row_factory_of_dicts(sqlite_file: Path, sqlite: Engine, outbox: Outbox) -> None:
    """The sqlite3 documentation's own recipe: rows as dicts, which cannot be read by
    position."""

    def dict_factory(cursor: sqlite3.Cursor, row: tuple[Any, ...]) -> dict[str, Any]:
        return {column[0]: value for column, value in zip(cursor.description, row, strict=True)}

    lite = sqlite3.connect(sqlite_file)
    try:
        lite.row_factory = dict_factory
        first = enqueue(outbox, lite)
        again = enqueue(outbox, lite)
        assert (first.created, again.created, again.id) == (True, False, first.id)
        assert lite.execute("SELECT 1 AS one").fetchone() == {"one": 1}
        lite.commit()
    finally:
        lite.close()
    assert count(sqlite) == 1


def test_sqlite_autocommit_without_a_transaction_is_refused_and_sends_nothing(
    sqlite_file: Path, sqlite: Engine, outbox: Outbox
) -> None:
    lite = sqlite3.connect(sqlite_file, isolation_level=None)
    sent: list[str] = []
    lite.set_trace_callback(sent.append)
    try:
        with pytest.raises(InvalidInput) as info:
            enqueue(outbox, lite)
        assert (info.value.code, sent) == ("no_transaction", [])
        lite.execute("BEGIN")
        enqueue(outbox, lite)
        lite.execute("ROLLBACK")
    finally:
        lite.close()
    assert count(sqlite) == 0


def test_sqlite_the_first_borrow_sends_only_the_intake_statement(
    sqlite_file: Path, outbox: Outbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(borrowed, "_engines", {})
    lite = sqlite3.connect(sqlite_file)
    sent: list[str] = []
    lite.set_trace_callback(lambda s: sent.append(s.split(None, 1)[0].upper()))
    try:
        enqueue(outbox, lite)
        # The module's own BEGIN before a write, and intake's INSERT (reported again at its
        # trigger: SQLite's trace fires at each subprogram); no PRAGMA.
        assert sent[0] == "BEGIN" and set(sent) == {"BEGIN", "INSERT"}
        lite.rollback()
    finally:
        lite.close()


def test_sqlite_a_savepoint_rolled_back_takes_its_intent(
    sqlite_file: Path, sqlite: Engine, outbox: Outbox
) -> None:
    lite = sqlite3.connect(sqlite_file, isolation_level=None)
    try:
        lite.execute("BEGIN")
        lite.execute(INSERT_SQLITE, ["A1042"])
        lite.execute("SAVEPOINT s1")
        enqueue(outbox, lite, op_id="op-dropped")
        lite.execute("ROLLBACK TO s1")
        lite.execute("RELEASE s1")
        enqueue(outbox, lite, op_id="op-kept")
        lite.execute("COMMIT")
    finally:
        lite.close()
    with Session(sqlite) as s:
        assert list(s.scalars(select(Operation.op_id))) == ["op-kept"]
    assert stored(sqlite) == (1, 1, 1)


def test_sqlite_a_closed_connection_is_refused(sqlite_file: Path, outbox: Outbox) -> None:
    lite = sqlite3.connect(sqlite_file)
    lite.close()
    with pytest.raises(InvalidInput) as info:
        enqueue(outbox, lite)
    assert info.value.code == "connection_closed"


def test_sqlite_a_thousand_borrows_keep_nothing(sqlite_file: Path, outbox: Outbox) -> None:
    lite = sqlite3.connect(sqlite_file)
    try:
        enqueue(outbox, lite)
        gc.collect()
        references = sys.getrefcount(lite)
        for _ in range(1000):
            enqueue(outbox, lite)
        gc.collect()
        assert sys.getrefcount(lite) == references
        lite.rollback()
    finally:
        lite.close()


# -- a SQLAlchemy Connection, sync and async ----------------------------------------------


def test_a_connection_in_autocommit_is_refused_and_left_as_it_was(
    pg: Engine, libpq: str, outbox: Outbox
) -> None:
    with pg.connect() as sa:
        auto = sa.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(InvalidInput) as info:
            enqueue(outbox, auto)
        assert info.value.code == "no_transaction"
        assert not auto.in_transaction()
    assert count(pg) == 0


def test_a_connection_in_error_is_refused(pg: Engine, libpq: str, outbox: Outbox) -> None:
    with pg.connect() as sa:
        with pytest.raises(Exception, match="division by zero"):
            sa.execute(text("SELECT 1/0"))
        with pytest.raises(InvalidInput) as info:
            enqueue(outbox, sa)
        assert info.value.code == "transaction_aborted"
        sa.rollback()
        enqueue(outbox, sa)
        sa.commit()
    assert count(pg) == 1


def test_a_closed_sqlalchemy_connection_is_refused(pg: Engine, outbox: Outbox) -> None:
    sa: Connection = pg.connect()
    sa.close()
    with pytest.raises(InvalidInput) as info:
        enqueue(outbox, sa)
    assert info.value.code == "connection_closed"


def test_a_nested_transaction_on_a_sqlalchemy_connection(
    pg: Engine, libpq: str, outbox: Outbox
) -> None:
    with pg.connect() as sa:
        sa.execute(refund_requests.insert(), {"order_id": "A1042"})
        nested = sa.begin_nested()
        enqueue(outbox, sa, op_id="op-dropped")
        nested.rollback()
        enqueue(outbox, sa, op_id="op-kept")
        sa.commit()
    with Session(pg) as s:
        assert list(s.scalars(select(Operation.op_id))) == ["op-kept"]
    assert stored(pg) == (1, 1, 1)


def test_an_async_connection(pg: Engine, pg_url: str, libpq: str, outbox: Outbox) -> None:
    door = AsyncOutbox(outbox)
    args: dict[str, Any] = {"tenant": "acme", "kind": "refund", "params": GOOD}

    async def main() -> tuple[Any, ...]:
        engine = create_async_engine(pg_url)
        try:
            async with engine.connect() as conn:
                await conn.execute(refund_requests.insert(), {"order_id": "A1042"})
                first = await door.enqueue(conn, op_id="op-1", **args)
                await conn.commit()
                again = await door.enqueue(conn, op_id="op-1", **args)
                with pytest.raises(IdempotencyConflict):
                    await door.enqueue(
                        conn, op_id="op-1", **{**args, "params": {**GOOD, "payee": "X"}}
                    )
                await conn.rollback()
                with pytest.raises(InvalidParams):
                    await door.enqueue(conn, op_id="op-2", **{**args, "params": {}})
                await door.enqueue(conn, op_id="op-rolled-back", **args)
                await conn.rollback()
            async with engine.connect() as conn:
                auto: AsyncConnection = await conn.execution_options(isolation_level="AUTOCOMMIT")
                with pytest.raises(InvalidInput) as info:
                    await door.enqueue(auto, op_id="op-3", **args)
            return first, again, info.value.code
        finally:
            await engine.dispose()

    first, again, refused = asyncio.run(main())
    assert first.created and (again.created, again.id) == (False, first.id)
    assert refused == "no_transaction"
    assert stored(pg) == (1, 1, 1)
