"""Shared fixtures: real PostgreSQL (started when none answers), Redis servers of each test's
own, SQLite files."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import logs
from outbox.db import make_engine, upgrade
from outbox.intake import Outbox
from outbox.kinds import default_registry
from outbox.models import Base
from outbox.settings import Settings
from tests.support import services
from tests.support.simtools import fenced

pytest_plugins = ["tests.support.sim", "tests.support.rig", "tests.support.no_skips"]

#: every table of the product's schema, read from its models: a table added later is emptied
#: between tests with no list to keep (a list by hand once missed one, and rows leaked)
TABLES = ", ".join(Base.metadata.tables)


#: Hypothesis: no per-example deadline (a loaded 2-core machine is slow, not wrong). ``explore``
#: (a bare ``pytest``) draws new examples each run and keeps what fails in ``.hypothesis``;
#: ``ci`` (``scripts/test.sh``, so CI) draws the same examples every run, so that a run passes or
#: fails by the code alone; a counterexample found exploring is kept as an ``@example``.
#: ``HYPOTHESIS_PROFILE`` picks one.
hypothesis_settings.register_profile("explore", deadline=None, print_blob=True)
hypothesis_settings.register_profile("ci", deadline=None, print_blob=True, derandomize=True)
#: ``thorough``: ``explore`` with 20 times the examples, to hunt before a release.
hypothesis_settings.register_profile(
    "thorough", hypothesis_settings.get_profile("explore"), max_examples=2000
)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "explore"))


def pytest_configure(config: pytest.Config) -> None:
    services.refuse_foreign_flushes()  # no test may flush a Redis the run did not start


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that spawn processes (``slow``: workers, a benchmark, a soak, a failover) run
    first, in their order, the rest after in theirs: with ``-n`` the long ones start while
    every process has short ones queued behind, instead of ending the run on one process
    while the others wait."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    with services.postgres_server() as url:
        yield url


@pytest.fixture(scope="session")
def pg_url(pg_server: str) -> Iterator[str]:
    """A migrated throwaway database for this test session."""
    name = f"settled_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with services.throwaway_database(pg_server, name) as url:
        upgrade(url)
        yield url


@pytest.fixture(scope="session")
def pg_engine(pg_url: str) -> Iterator[Engine]:
    engine = make_engine(pg_url)
    yield engine
    engine.dispose()


def truncate(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE"))


@pytest.fixture
def pg(pg_engine: Engine) -> Iterator[Engine]:
    """The session's PostgreSQL engine, emptied after the test."""
    yield pg_engine
    truncate(pg_engine)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SQLite file migrated once per test process, copied for each test (``sqlite``)."""
    path = tmp_path_factory.mktemp("sqlite-template") / "settled.sqlite3"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def sqlite(tmp_path: Path, sqlite_template: Path) -> Iterator[Engine]:
    """A migrated SQLite file of this test's own (a copy of the migrated template)."""
    path = tmp_path / "settled.sqlite3"
    shutil.copyfile(sqlite_template, path)
    engine = make_engine(f"sqlite:///{path}")
    yield engine
    engine.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def engine(request: pytest.FixtureRequest) -> Engine:
    """Runs the test once against PostgreSQL and once against an SQLite file."""
    return request.getfixturevalue("pg" if request.param == "postgresql" else "sqlite")  # type: ignore[no-any-return]


@pytest.fixture
def session(engine: Engine) -> Iterator[Session]:
    with Session(engine) as s:
        yield s


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A Redis server of this test's own (database 0), stopped after the test: the tests
    flush, kill and restart it, so it is never one they did not start."""
    with services.redis_server() as url:
        yield url


@pytest.fixture
def settings() -> Settings:
    return Settings(
        fingerprint_keys={"v1": "test-fingerprint-key-0001"},  # type: ignore[dict-item]
        idempotency_secret="test-idempotency-secret",  # type: ignore[arg-type]
    )


@pytest.fixture
def outbox(settings: Settings) -> Outbox:
    """The default kinds, their contracts as the simulator (the tests' downstream) keeps
    them: it enforces the deadline (``tests.support.simtools.fenced``)."""
    return Outbox.from_settings(settings, fenced(default_registry()))


@pytest.fixture
def settled_logging() -> Iterator[None]:
    """``logs.configure`` changes process-wide loggers: put them back afterwards."""
    names = ["", *logs.QUIETED, *logs.SILENCED]
    saved = [(logging.getLogger(n), logging.getLogger(n).handlers[:]) for n in names]
    levels = [lg.level for lg, _ in saved]
    try:
        yield
    finally:
        for (lg, handlers), level in zip(saved, levels, strict=True):
            lg.handlers[:] = handlers
            lg.setLevel(level)
