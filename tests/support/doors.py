"""Intake doors for the contract tests (``tests/integration/test_intake_doors.py``): each way an
app writes an operation intent in its own transaction, behind one small interface, so that
every case of the contract is asserted the same way on every door.

A door opens a transaction of the app's (``Door.begin``), in which the app writes a row of its
own (``Transaction.app_write``) and enqueues with the door's own call
(``Transaction.enqueue``), then commits or rolls back; ``Door.hints`` are the hint messages the
door published (the relay's, or the app's after its commit), and ``Door.last_statements`` the
SQL statements the door's last enqueue sent, counted where the door sends them (for the
SQLAlchemy doors: ``before_cursor_execute`` on the door's own engine, so the test's own
statements, on another engine, are never among them).

Adding a door (a plain psycopg connection, a Django connection) is adding one subclass of
``Door`` to ``DOORS``: ``databases`` (where it runs), ``begin`` (a ``Transaction`` of its own,
whose ``enqueue`` runs inside ``Door.counted``), ``close``, and a way of counting what it sends
(``count_on`` an engine, or its own appends to ``last_statements`` while counting).
"""

from __future__ import annotations

import asyncio
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, event, make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import sessionmaker

from outbox import relay
from outbox.aio import AsyncOutbox
from outbox.borrowed import borrowed
from outbox.db import make_engine
from outbox.intake import Enqueued, Outbox
from tests.support.services import libpq_url

T = TypeVar("T")

#: The app's own table, written in the same transaction as the intent (``app_write``; a door
#: on a DB-API connection writes ``INSERT INTO intake_door_requests (order_id) VALUES (...)``).
APP_TABLE = "intake_door_requests"
app_rows = Table(
    APP_TABLE,
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("order_id", String(64)),
)


class Transaction(ABC):
    """A transaction the app opened on a door. Leaving it as a context manager rolls back
    whatever was neither committed nor rolled back."""

    ended = False

    @abstractmethod
    def enqueue(self, **intake: Any) -> Enqueued:
        """The door's enqueue call in this transaction (``Outbox.enqueue``'s arguments),
        its statements counted into ``Door.last_statements``."""

    @abstractmethod
    def app_write(self, order_id: str) -> None:
        """A row of the app's own (``APP_TABLE``) in this transaction."""

    @abstractmethod
    def commit(self) -> None: ...

    @abstractmethod
    def rollback(self) -> None: ...

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.ended:
            self.rollback()


class Door(ABC):
    """One way into intake, on the database at ``url``; ``publish`` (if given) also gets each
    hint message, e.g. a Celery broker's (``settled.celery_app.hint_publisher``)."""

    #: the name in test ids
    name: ClassVar[str]
    #: the databases it runs on ("postgresql", "sqlite")
    databases: ClassVar[frozenset[str]]

    def __init__(self, url: str, outbox: Outbox, publish: relay.Publish | None = None) -> None:
        self.url = url
        self.outbox = outbox
        self.hints: list[list[int]] = []
        self.last_statements: list[str] = []
        self._counting = False
        self._forward = publish

    @abstractmethod
    def begin(self) -> Transaction:
        """A transaction of the app's, open (begun on the database) on this door."""

    @abstractmethod
    def close(self) -> None:
        """Release what the door holds (engines, connections, an event loop)."""

    def published(self, ids: Sequence[int]) -> None:
        """The door's publish: one hint message of these ids."""
        self.hints.append(list(ids))
        if self._forward is not None:
            self._forward(ids)

    @contextmanager
    def counted(self) -> Iterator[None]:
        """Count the statements the door sends meanwhile into ``last_statements``."""
        self.last_statements = []
        self._counting = True
        try:
            yield
        finally:
            self._counting = False

    def count_on(self, engine: Engine) -> None:
        """Count the statements of ``engine`` (the door's own) while ``counted``."""

        def seen(_c: Any, _cursor: Any, statement: str, *_: Any) -> None:
            if self._counting:
                self.last_statements.append(statement)

        event.listen(engine, "before_cursor_execute", seen)


class SessionDoor(Door):
    """``Outbox.enqueue`` on the app's SQLAlchemy ``Session``, the relay on its
    ``sessionmaker``."""

    name = "session"
    databases = frozenset({"postgresql", "sqlite"})

    def __init__(self, url: str, outbox: Outbox, publish: relay.Publish | None = None) -> None:
        super().__init__(url, outbox, publish)
        self.engine = make_engine(url)
        self.count_on(self.engine)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        relay.install(self.sessions, self.published)

    def begin(self) -> Transaction:
        return _SessionTransaction(self)

    def close(self) -> None:
        self.engine.dispose()


class _SessionTransaction(Transaction):
    def __init__(self, door: SessionDoor) -> None:
        self.door = door
        self.session = door.sessions()
        self.session.begin()
        self.session.connection()  # begun on the database now (SQLite: BEGIN IMMEDIATE)

    def enqueue(self, **intake: Any) -> Enqueued:
        with self.door.counted():
            return self.door.outbox.enqueue(self.session, **intake)

    def app_write(self, order_id: str) -> None:
        self.session.execute(app_rows.insert().values(order_id=order_id))

    def commit(self) -> None:
        self.ended = True
        self.session.commit()
        self.session.close()

    def rollback(self) -> None:
        self.ended = True
        self.session.rollback()
        self.session.close()


class AsyncSessionDoor(Door):
    """``AsyncOutbox.enqueue`` on the app's ``AsyncSession`` (psycopg's async driver), the
    relay on its ``async_sessionmaker``; driven from the tests through an event loop of its
    own (``run``)."""

    name = "async_session"
    databases = frozenset({"postgresql"})

    def __init__(self, url: str, outbox: Outbox, publish: relay.Publish | None = None) -> None:
        super().__init__(url, outbox, publish)
        self.loop = asyncio.new_event_loop()
        self.engine = create_async_engine(url, hide_parameters=True)
        self.count_on(self.engine.sync_engine)
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        relay.install(self.sessions, self.published)
        self.aio = AsyncOutbox(outbox)

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        """``work`` run to its end on the door's event loop."""
        return self.loop.run_until_complete(work)

    def begin(self) -> Transaction:
        return _AsyncSessionTransaction(self)

    def close(self) -> None:
        try:
            self.run(self.engine.dispose())
        finally:
            self.loop.close()


class _AsyncSessionTransaction(Transaction):
    def __init__(self, door: AsyncSessionDoor) -> None:
        self.door = door
        self.session: AsyncSession = door.sessions()

        async def begin() -> None:
            await self.session.begin()
            await self.session.connection()

        door.run(begin())

    def enqueue(self, **intake: Any) -> Enqueued:
        with self.door.counted():
            return self.door.run(self.door.aio.enqueue(self.session, **intake))

    def app_write(self, order_id: str) -> None:
        self.door.run(self.session.execute(app_rows.insert().values(order_id=order_id)))

    def commit(self) -> None:
        self.ended = True
        self.door.run(self.session.commit())
        self.door.run(self.session.close())

    def rollback(self) -> None:
        self.ended = True
        self.door.run(self.session.rollback())
        self.door.run(self.session.close())


class _ConnectionDoor(Door):
    """A door on a connection: the app publishes its hints after its commit
    (``relay.publish_hints``), there being no commit event to hang the relay on."""

    def __init__(self, url: str, outbox: Outbox, publish: relay.Publish | None = None) -> None:
        super().__init__(url, outbox, publish)
        self._listening: list[tuple[Engine, Any]] = []

    def count_on(self, engine: Engine) -> None:
        def seen(_c: Any, _cursor: Any, statement: str, *_: Any) -> None:
            if self._counting:
                self.last_statements.append(statement)

        event.listen(engine, "before_cursor_execute", seen)
        self._listening.append((engine, seen))

    def close(self) -> None:
        for engine, seen in self._listening:  # the borrowed engines are the process's
            event.remove(engine, "before_cursor_execute", seen)


class _AppCommits(Transaction):
    """A connection transaction that hints, after its commit, the intents it created."""

    door: _ConnectionDoor

    def __init__(self) -> None:
        self.created: list[int] = []

    def enqueue(self, **intake: Any) -> Enqueued:
        with self.door.counted():
            got = self.send(**intake)
        if got.created:
            self.created.append(got.id)
        return got

    @abstractmethod
    def send(self, **intake: Any) -> Enqueued: ...

    @abstractmethod
    def end(self, commit: bool) -> None: ...

    def commit(self) -> None:
        self.ended = True
        self.end(True)
        relay.publish_hints(self.door.published, self.created)

    def rollback(self) -> None:
        self.ended = True
        self.end(False)


class ConnectionDoor(_ConnectionDoor):
    """``Outbox.enqueue`` on the app's SQLAlchemy ``Connection``."""

    name = "connection"
    databases = frozenset({"postgresql", "sqlite"})

    def __init__(self, url: str, outbox: Outbox, publish: relay.Publish | None = None) -> None:
        super().__init__(url, outbox, publish)
        self.engine = make_engine(url)
        self.count_on(self.engine)

    def begin(self) -> Transaction:
        return _ConnectionTransaction(self)

    def close(self) -> None:
        super().close()
        self.engine.dispose()


class _ConnectionTransaction(_AppCommits):
    door: ConnectionDoor

    def __init__(self, door: ConnectionDoor) -> None:
        super().__init__()
        self.door = door
        self.connection = door.engine.connect()
        self.connection.begin()

    def send(self, **intake: Any) -> Enqueued:
        return self.door.outbox.enqueue(self.connection, **intake)

    def app_write(self, order_id: str) -> None:
        self.connection.execute(app_rows.insert().values(order_id=order_id))

    def end(self, commit: bool) -> None:
        (self.connection.commit if commit else self.connection.rollback)()
        self.connection.close()


class PsycopgDoor(_ConnectionDoor):
    """``Outbox.enqueue`` on the app's own psycopg 3 connection (rows as dicts, as many apps
    have them)."""

    name = "psycopg"
    databases = frozenset({"postgresql"})

    def __init__(self, url: str, outbox: Outbox, publish: relay.Publish | None = None) -> None:
        super().__init__(url, outbox, publish)
        self.conn = psycopg.connect(libpq_url(url), row_factory=dict_row)
        with borrowed(self.conn) as connection:  # the process's engine for such connections
            self.count_on(connection.engine)
        self.conn.rollback()

    def begin(self) -> Transaction:
        return _PsycopgTransaction(self)

    def close(self) -> None:
        super().close()
        self.conn.close()


class _PsycopgTransaction(_AppCommits):
    door: PsycopgDoor

    def __init__(self, door: PsycopgDoor) -> None:
        super().__init__()
        self.door = door
        door.conn.execute("SELECT 1")  # begun on the database now

    def send(self, **intake: Any) -> Enqueued:
        return self.door.outbox.enqueue(self.door.conn, **intake)

    def app_write(self, order_id: str) -> None:
        self.door.conn.execute(f"INSERT INTO {APP_TABLE} (order_id) VALUES (%s)", [order_id])

    def end(self, commit: bool) -> None:
        (self.door.conn.commit if commit else self.door.conn.rollback)()


class Sqlite3Door(_ConnectionDoor):
    """``Outbox.enqueue`` on the app's own sqlite3 connection, its transactions begun by the
    app (``BEGIN IMMEDIATE``)."""

    name = "sqlite3"
    databases = frozenset({"sqlite"})

    def __init__(self, url: str, outbox: Outbox, publish: relay.Publish | None = None) -> None:
        super().__init__(url, outbox, publish)
        path = make_url(url).database
        assert path, url
        self.conn = sqlite3.connect(path, timeout=30, isolation_level=None)
        self.conn.execute("BEGIN")
        with borrowed(self.conn) as connection:
            self.count_on(connection.engine)
        self.conn.execute("ROLLBACK")

    def begin(self) -> Transaction:
        return _Sqlite3Transaction(self)

    def close(self) -> None:
        super().close()
        self.conn.close()


class _Sqlite3Transaction(_AppCommits):
    door: Sqlite3Door

    def __init__(self, door: Sqlite3Door) -> None:
        super().__init__()
        self.door = door
        door.conn.execute("BEGIN IMMEDIATE")

    def send(self, **intake: Any) -> Enqueued:
        return self.door.outbox.enqueue(self.door.conn, **intake)

    def app_write(self, order_id: str) -> None:
        self.door.conn.execute(f"INSERT INTO {APP_TABLE} (order_id) VALUES (?)", [order_id])

    def end(self, commit: bool) -> None:
        self.door.conn.execute("COMMIT" if commit else "ROLLBACK")


#: Every door the contract is asserted on (the Django door's are in test_django.py: Django's
#: settings are configured once per process there).
DOORS: list[type[Door]] = [SessionDoor, AsyncSessionDoor, ConnectionDoor, PsycopgDoor, Sqlite3Door]
