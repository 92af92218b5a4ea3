"""Engines, database time, and migrations."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, Float, Select, bindparam, create_engine, event, make_url
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session, SessionTransaction, SessionTransactionOrigin
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import BindParameter, ColumnElement, FunctionElement
from sqlalchemy.sql.visitors import InternalTraversal
from sqlalchemy.types import NullType

from outbox.errors import SettledError
from outbox.models import UTCDateTime

MIGRATIONS = Path(__file__).parent / "migrations"

#: How a connection's SQLite transaction begins (an execution option; ``make_engine``).
#: ``IMMEDIATE`` takes the one write lock at ``BEGIN``, waiting for it (the busy timeout): a
#: deferred transaction that read before it writes cannot take it once another connection has
#: committed (SQLITE_BUSY_SNAPSHOT: "database is locked" at once, the busy handler never
#: asked). ``DEFERRED`` takes a snapshot and no lock: in WAL mode such a reader never waits.
SQLITE_BEGIN = "settled_sqlite_begin"
_IMMEDIATE, _DEFERRED = "IMMEDIATE", "DEFERRED"


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for ``url``; SQLite files get WAL, a busy timeout, foreign keys, and
    transactions that take the write lock when they begin unless they only read
    (``SQLITE_BEGIN``). A statement's parameters (an intent's payee, amount, order) never
    appear in an error's text, nor in SQLAlchemy's log (``hide_parameters``)."""
    kwargs.setdefault("hide_parameters", True)
    if url.startswith("sqlite"):
        kwargs.setdefault("connect_args", {"timeout": 30})
        engine = create_engine(url, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # pysqlite's own transaction handling is off; SQLAlchemy emits BEGIN (see below).
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            # IMMEDIATE unless a session began the transaction by itself (``SQLITE_BEGIN``).
            conn.exec_driver_sql(
                f"BEGIN {conn.get_execution_options().get(SQLITE_BEGIN, _IMMEDIATE)}"
            )

        return engine
    kwargs.setdefault("pool_pre_ping", True)
    url, threshold = _prepare_threshold(url)
    if threshold is not _UNSET:
        kwargs["connect_args"] = {**kwargs.get("connect_args", {}), "prepare_threshold": threshold}
    return create_engine(url, **kwargs)


_UNSET: Any = object()


def _prepare_threshold(url: str) -> tuple[Any, Any]:
    """``url`` without its ``prepare_threshold`` query parameter, and psycopg's
    ``prepare_threshold`` from it: an integer, or None for ``none`` (never prepare on the
    server: PgBouncer < 1.21 in transaction mode). psycopg would take the URL's text as is and
    fail at the fifth execution of a statement. Raises SettledError (``invalid_setting``) for
    another value."""
    parsed = make_url(url)
    if "prepare_threshold" not in parsed.query:
        return parsed, _UNSET
    value = parsed.query["prepare_threshold"]
    value = value[-1] if isinstance(value, tuple) else value
    rest = parsed.difference_update_query(["prepare_threshold"])
    if value.strip().lower() == "none":
        return rest, None
    if value.strip().isdigit():
        return rest, int(value)
    raise SettledError(
        "SETTLED_DATABASE_URL: prepare_threshold must be a whole number or none",
        code="invalid_setting",
        setting="SETTLED_DATABASE_URL",
    )


@event.listens_for(Session, "after_transaction_create")
def _session_begin(session: Session, transaction: SessionTransaction) -> None:
    """On SQLite, a session's transaction begun explicitly (``with session.begin()``,
    ``sessionmaker.begin()``: Settled's, and an app's, way to write) is ``IMMEDIATE``; one the
    session began by itself at its first statement (a session used to read) is deferred.
    Connections outside a session (``engine.begin()``, a worker's step, migrations) are
    ``IMMEDIATE``. Nothing changes on another database."""
    bind = session.bind
    if transaction.parent is None and (bind is None or bind.dialect.name == "sqlite"):
        autobegun = transaction.origin is SessionTransactionOrigin.AUTOBEGIN
        begin = _DEFERRED if autobegun else _IMMEDIATE
        if session.execution_options.get(SQLITE_BEGIN) != begin:
            session.execution_options = session.execution_options.union({SQLITE_BEGIN: begin})


class db_now(FunctionElement[Any]):
    """The database's clock plus ``offset`` seconds (leases and due times use database time).

    The offset is a bound parameter, so one cached statement serves every offset.
    """

    type = UTCDateTime()
    inherit_cache = True

    def __init__(self, offset: float | BindParameter[float] = 0.0) -> None:
        if isinstance(offset, BindParameter):  # a named parameter, given at execution
            super().__init__(offset)
        else:
            super().__init__(bindparam(None, float(offset), type_=Float()))


@compiles(db_now, "postgresql")
def _pg_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    offset = compiler.process(element.clauses, **kw)
    return f"(clock_timestamp() + make_interval(secs => {offset}))"


@compiles(db_now, "sqlite")
def _sqlite_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    offset = compiler.process(element.clauses, **kw)
    return f"strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', {offset}))"


class db_statement_now(db_now):
    """The database's clock when the statement started, plus ``offset`` seconds: for the
    comparisons of a WHERE clause (due, lease expired).

    ``db_now`` reads the clock at each call (PostgreSQL's ``clock_timestamp()``, volatile), so
    the planner cannot use it against an index: a claim's ``next_attempt_at <= db_now()`` sorts
    every due row to find the oldest few. ``statement_timestamp()`` is stable, so the same
    comparison is an index condition. It is at most the statement's own duration earlier than
    ``db_now()``: an operation due or a lease expiring within that instant is taken by the next
    claim instead, never early. SQLite's ``'now'`` is already the statement's time.
    """

    inherit_cache = True


class in_once(ColumnElement[Any]):
    """``column IN (candidates)``, with the sub-select run exactly once.

    For a claim (``UPDATE ... WHERE id IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)``).
    PostgreSQL may plan a plain ``IN`` as a nested-loop semi-join that runs the sub-select, its
    LIMIT and its row locks, again for every row of the outer scan, and then updates far more
    than ``n`` rows (seen: LIMIT 8 claimed all 300 due rows once the table had statistics).
    There it is ``column = ANY(ARRAY(...))``: the array is an init-plan, run once, and the
    UPDATE finds its rows by primary key. SQLite runs an uncorrelated ``IN`` once.
    """

    type = NullType()  # a condition, but not a boolean column: no "= 1" on SQLite
    inherit_cache = True
    _traverse_internals = [  # noqa: RUF012 (SQLAlchemy declares it an instance attribute)
        ("column", InternalTraversal.dp_clauseelement),
        ("candidates", InternalTraversal.dp_clauseelement),
    ]

    def __init__(self, column: ColumnElement[Any], candidates: Select[Any]) -> None:
        self.column = column
        self.candidates = candidates.scalar_subquery()


@compiles(in_once)
def _in_once(element: in_once, compiler: SQLCompiler, **kw: Any) -> str:
    column = compiler.process(element.column, **kw)
    return f"{column} IN {compiler.process(element.candidates, **kw)}"


@compiles(in_once, "postgresql")
def _pg_in_once(element: in_once, compiler: SQLCompiler, **kw: Any) -> str:
    column = compiler.process(element.column, **kw)
    return f"{column} = ANY(ARRAY{compiler.process(element.candidates, **kw)})"


@compiles(db_statement_now, "postgresql")
def _pg_statement_now(element: db_statement_now, compiler: SQLCompiler, **kw: Any) -> str:
    offset = compiler.process(element.clauses, **kw)
    return f"(statement_timestamp() + make_interval(secs => {offset}))"


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def schema_heads(url: str) -> set[str]:
    """The newest revisions of the migration scripts (one: migrations are a line)."""
    from alembic.script import ScriptDirectory

    alembic_log = logging.getLogger("alembic")
    level = alembic_log.level
    alembic_log.setLevel(logging.WARNING)  # loading the scripts logs its plugins at INFO
    try:
        return set(ScriptDirectory.from_config(alembic_config(url)).get_heads())
    finally:
        alembic_log.setLevel(level)


def sqlite_file(url: str) -> Path | None:
    """The file of an SQLite URL (None: not SQLite, or in memory)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database).resolve()


def schema_revisions(url: str) -> set[str]:
    """The revisions the database at ``url`` is at (empty: never migrated). An SQLite file
    that does not exist is at nothing, and is not created. Connection errors are raised as
    they come (DBAPIError)."""
    from sqlalchemy.pool import NullPool

    from outbox.storage.schema import applied_revisions  # here: storage imports this module

    path = sqlite_file(url)
    if path is not None and not path.exists():
        return set()
    engine = make_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return applied_revisions(conn)
    finally:
        engine.dispose()


def check_schema(url: str) -> str:
    """The revision the database at ``url`` is at; raise SettledError
    (``database_not_migrated``) unless it is the newest migration. Connection errors are
    raised as they come (DBAPIError). Writes nothing (an SQLite file is never created)."""
    current = schema_revisions(url)
    newest = schema_heads(url)
    if current != newest:
        raise SettledError(
            f"the database is not migrated (at {sorted(current) or 'nothing'}, newest "
            f"{sorted(newest)}): run `settled db upgrade`",
            code="database_not_migrated",
        )
    return ", ".join(sorted(current))


def upgrade(url: str, revision: str = "head") -> tuple[set[str], set[str]]:
    """Apply migrations up to ``revision``; return the revisions the database was at before
    and is at after."""
    from alembic import command

    before = schema_revisions(url)
    command.upgrade(alembic_config(url), revision)
    return before, schema_revisions(url)


def hosts_in_query(url: str) -> str:
    """libpq's multi-host URL (``postgresql://u@h1:5432,h2:5433/db``) as SQLAlchemy reads it
    (``postgresql://u@/db?host=h1:5432&host=h2:5433``, psycopg then tries each in turn);
    any other URL as it is."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    if not parts.scheme.startswith("postgresql") or "," not in hostlist:
        return url
    hosts = "&".join(f"host={h}" for h in hostlist.split(",") if h)
    query = f"{hosts}&{parts.query}" if parts.query else hosts
    return urlunsplit(parts._replace(netloc=userinfo + at, query=query))


def database_hosts(url: str) -> list[tuple[str, int | None]]:
    """The ``(host, port)`` pairs a PostgreSQL URL names: one, or each of a multi-host URL
    (libpq's ``h1:p1,h2:p2``, or ``?host=h1:p1&host=h2:p2``, or ``?host=h1,h2&port=p1,p2``);
    none for another database."""
    parsed = make_url(hosts_in_query(url))
    if parsed.get_backend_name() != "postgresql":
        return []
    names = _listed(parsed.query.get("host"))
    if not names:
        return [(parsed.host or "localhost", parsed.port)]
    ports = _listed(parsed.query.get("port"))
    pairs: list[tuple[str, int | None]] = []
    for n, name in enumerate(names):
        host, sep, port = name.rpartition(":")
        if not sep or not port.isdigit():  # no port of its own: the port list's, if any
            host, port = name, ports[n] if n < len(ports) else ""
        pairs.append((host, int(port) if port.isdigit() else None))
    return pairs


def _listed(value: str | tuple[str, ...] | None) -> list[str]:
    """A URL query's value, repeated or comma-separated, as one list."""
    values = [value] if isinstance(value, str) else list(value or ())
    return [part for v in values for part in v.split(",") if part]
