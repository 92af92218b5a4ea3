"""The composition root's runtime: each service built once, on first use, and a runtime over
the caller's sessions leaves the caller's engine alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker

from outbox.settings import Settings
from outbox.testing import FakeGateway
from settled.runtime import build_runtime


def test_each_service_is_built_once_and_only_when_asked_for(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'settled.sqlite3'}")
    rt = build_runtime(settings, gateway=FakeGateway())
    try:
        assert "executor" not in rt._built and "review" not in rt._built  # nothing yet
        assert rt.review is rt.review and rt.executor is rt.executor
        assert rt.approvals.proposals is rt.proposals and rt.proposals.outbox is rt.outbox
        assert rt.coalescer() is rt.coalescer()
        assert rt.wechatpay_notifications is rt.wechatpay_notifications
    finally:
        rt.close()


def test_a_runtime_over_the_callers_sessions_leaves_their_engine_open(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'app.sqlite3'}")
    sessions = sessionmaker(engine, expire_on_commit=False)
    with engine.connect() as conn:
        conn.execute(text("select 1"))
    pool = engine.pool
    rt = build_runtime(Settings(), sessions=sessions, gateway=FakeGateway())
    assert rt.sessions is sessions and rt.engine is engine
    assert rt.review.sessions is sessions  # built over the caller's sessions
    rt.close()
    assert engine.pool is pool  # not disposed (disposing replaces the pool)
    assert pool.checkedin() == 1  # its pooled connection is still there
    engine.dispose()


def test_sessions_bound_to_no_engine_are_refused() -> None:
    with pytest.raises(TypeError, match="bound to an Engine"):
        build_runtime(Settings(), sessions=sessionmaker())
