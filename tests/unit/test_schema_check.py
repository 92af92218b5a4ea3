"""``outbox.db.check_schema``, the check every long-running process makes before it starts:
the database must be at the newest migration (read by ``outbox.storage.schema``). Against
SQLite files (no servers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy.pool import NullPool

from outbox.db import alembic_config, check_schema, make_engine, upgrade
from outbox.errors import SettledError
from outbox.storage.schema import applied_revisions


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'settled.sqlite3'}"


def revisions(url: str) -> set[str]:
    engine = make_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return applied_revisions(conn)
    finally:
        engine.dispose()


def newest(url: str) -> list[str]:
    """The heads of the migration scripts (one today: migrations are a line)."""
    return sorted(ScriptDirectory.from_config(alembic_config(url)).get_heads())


def test_a_database_at_the_newest_migration_passes(url: str) -> None:
    upgrade(url)
    assert sorted(revisions(url)) == newest(url)
    check_schema(url)


def test_a_database_never_migrated_is_at_nothing(url: str) -> None:
    assert revisions(url) == set()
    with pytest.raises(SettledError) as caught:
        check_schema(url)
    assert caught.value.code == "database_not_migrated"
    assert "at nothing" in caught.value.message and "settled db upgrade" in caught.value.message


def test_a_database_behind_names_where_it_is_and_the_newest(url: str) -> None:
    upgrade(url, "0002")
    assert revisions(url) == {"0002"}
    with pytest.raises(SettledError) as caught:
        check_schema(url)
    assert caught.value.code == "database_not_migrated"
    assert f"at ['0002'], newest {newest(url)}" in caught.value.message
    assert newest(url) != ["0002"]
