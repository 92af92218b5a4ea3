"""What a database says of its own schema: the migrations (Alembic revisions) it is at."""

from __future__ import annotations

from sqlalchemy import Connection, column, inspect, select, table

#: Alembic's own table (not one of ours: no model), one row per head the database is at.
ALEMBIC_VERSION = table("alembic_version", column("version_num"))
APPLIED_REVISIONS = select(ALEMBIC_VERSION.c.version_num)


def applied_revisions(conn: Connection) -> set[str]:
    """The revisions the database is at (empty: never migrated, no ``alembic_version``)."""
    if not inspect(conn).has_table(ALEMBIC_VERSION.name):
        return set()
    return set(conn.scalars(APPLIED_REVISIONS))
