"""How a transaction begins on an SQLite engine from ``make_engine`` (``outbox.db``): begun
explicitly it takes the write lock at once (``BEGIN IMMEDIATE``), so what it read before it
writes cannot go stale; a session that began by itself only reads, deferred, and never waits
for a writer (WAL)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, event, select
from sqlalchemy.orm import Session, sessionmaker

from outbox.models import Run


@contextmanager
def begins(engine: Engine) -> Iterator[list[str]]:
    """The BEGIN statements run on ``engine`` meanwhile."""
    seen: list[str] = []

    def keep(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        if statement.startswith("BEGIN"):
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", keep)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", keep)


def test_explicit_transactions_take_the_write_lock_and_autobegun_reads_do_not(
    sqlite: Engine,
) -> None:
    sessions = sessionmaker(sqlite)
    query = select(Run.id)
    with begins(sqlite) as seen:
        with sessions() as s:
            s.execute(query)  # a read: the session began by itself
            s.commit()
            s.execute(query)
        with sessions.begin() as s:
            s.execute(query)
        with Session(sqlite) as s, s.begin():
            s.execute(query)
        with sqlite.begin() as conn:  # a worker's step
            conn.execute(query)
        with sqlite.connect() as conn:  # outside a session: a migration
            conn.execute(query)
    assert seen == ["BEGIN DEFERRED"] * 2 + ["BEGIN IMMEDIATE"] * 4


def test_a_reader_does_not_wait_for_a_writer_holding_the_lock(sqlite: Engine) -> None:
    sessions = sessionmaker(sqlite)
    with sessions.begin() as writer:
        writer.add(Run(tenant="acme", handle="h-1"))
        writer.flush()  # holds the write lock, uncommitted
        with sessions() as reader:  # would wait out the busy timeout if it took the lock
            assert reader.scalars(select(Run.handle)).all() == []
    with sessions() as reader:
        assert reader.scalars(select(Run.handle)).all() == ["h-1"]
