"""Database time: the clock every lease and due time is measured against."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import Engine, select

from outbox.db import db_now


def test_each_offset_is_applied_even_when_the_statement_is_cached(engine: Engine) -> None:
    with engine.connect() as conn:
        for offset in (1000.0, 0.0, 5000.0, -60.0):
            now, later = conn.execute(select(db_now(), db_now(offset))).one()
            assert abs((later - now) - timedelta(seconds=offset)) < timedelta(seconds=1)


def test_database_time_is_aware_utc(engine: Engine) -> None:
    with engine.connect() as conn:
        now = conn.execute(select(db_now())).scalar_one()
    assert now.utcoffset() == timedelta(0)
