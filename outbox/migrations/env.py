"""Alembic environment: one set of migrations for PostgreSQL and SQLite."""

from __future__ import annotations

from alembic import context

from outbox.db import make_engine
from outbox.models import Base

config = context.config
url = config.get_main_option("sqlalchemy.url")
assert url, "sqlalchemy.url must be set"

engine = make_engine(url)
with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
