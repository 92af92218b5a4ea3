"""The primary's replication made visible, on a real primary and a real streaming standby
(two private PostgreSQL clusters of this module's own: ``initdb``, ``pg_basebackup -R``).

A primary whose standby is asynchronous can lose, on a failover, whole operations the app
committed, refunds the downstream already carried out among them (issue 45, finding 2):
every start says the replication in its line and warns, and the metrics say it; an operator
who accepts it says so (``SETTLED_ASYNC_REPLICATION_ACCEPTED``) and the line says it instead.
A synchronous standby starts quietly. ``settled check`` with a multi-host URL names each host
with its role, or its error, not only the last host's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from click.testing import CliRunner, Result
from sqlalchemy.orm import sessionmaker

from outbox.db import make_engine, upgrade
from outbox.settings import Settings
from settled.cli import main
from settled.metrics import registry
from settled.preflight import announce, preflight
from tests.support.services import PostgresCluster, free_port
from tests.support.simtools import wait_until

#: ``settled check`` runs in this process and configures its logging: put it back after each
pytestmark = [pytest.mark.postgres, pytest.mark.usefixtures("settled_logging")]

KEYS = {"v1": "test-fingerprint-key-0001"}
SECRET = "test-idempotency-secret"


@dataclass
class Pair:
    primary: PostgresCluster
    standby: PostgresCluster

    def url(self, *hosts: int, query: str = "") -> str:
        """libpq's URL of the ``settled`` database on these ports (the primary's: none)."""
        where = ",".join(f"127.0.0.1:{port}" for port in hosts or (self.primary.port,))
        return f"postgresql://postgres@{where}/settled" + (f"?{query}" if query else "")

    def modes(self) -> dict[str, str]:
        with psycopg.connect(self.primary.url) as conn:
            rows = conn.execute("SELECT application_name, sync_state FROM pg_stat_replication")
            return dict(rows.fetchall())

    def synchronous(self, names: str) -> None:
        """``synchronous_standby_names`` on the primary, waited for until the standby's mode
        shows it."""
        with psycopg.connect(self.primary.url, autocommit=True) as conn:
            conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
            conn.execute("SELECT pg_reload_conf()")
        mode = "sync" if names else "async"
        wait_until(lambda: self.modes() == {"standby1": mode}, 30, f"the standby {mode}")


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    primary = PostgresCluster(name="primary")
    standby: PostgresCluster | None = None
    try:
        primary.start()
        with psycopg.connect(primary.url, autocommit=True) as conn:
            conn.execute("CREATE DATABASE settled")
        upgrade(f"postgresql+psycopg://postgres@127.0.0.1:{primary.port}/settled")
        standby = PostgresCluster(standby_of=primary, name="standby1")
        standby.start()
        both = Pair(primary, standby)
        wait_until(lambda: both.modes() == {"standby1": "async"}, 30, "the standby to stream")
        yield both
    finally:
        if standby is not None:
            standby.close()
        primary.close()


def check(url: str, **env: str) -> Result:
    """``settled check`` (no broker, no probe: the database alone), its settings from the
    environment as a deployment's."""
    environ = {
        "SETTLED_DATABASE_URL": url,
        "SETTLED_FINGERPRINT_KEYS": json.dumps(KEYS),
        "SETTLED_IDEMPOTENCY_SECRET": SECRET,
        **env,
    }
    return CliRunner().invoke(main, ["check", "--no-broker", "--no-probe"], env=environ)


def started(
    url: str, caplog: pytest.LogCaptureFixture, **settings: object
) -> list[logging.LogRecord]:
    """The lines a worker's start says (``settled.preflight``: its line, its warnings)."""
    caplog.clear()
    values = Settings(database_url=url, fingerprint_keys=KEYS, idempotency_secret=SECRET)
    announce(preflight(values.model_copy(update=settings), broker=False), "worker")
    return [r for r in caplog.records if r.name == "settled.start"]


def metric(url: str, name: str, **labels: str) -> float | None:
    engine = make_engine(Settings(database_url=url).database_url)
    try:
        return registry(sessionmaker(engine)).get_sample_value(name, labels)
    finally:
        engine.dispose()


def test_an_asynchronous_standby_warns_at_every_start_and_sets_the_metric(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    pair.synchronous("")
    said = (
        "replication (synchronous_commit on, synchronous_standby_names '', standbys standby1 async)"
    )
    for _ in range(2):  # every start, not the first only
        start, warned = started(pair.url(), caplog)
        assert said in start.getMessage() and start.levelno == logging.INFO
        assert start.standbys == "standby1:async"  # type: ignore[attr-defined]
        assert warned.levelno == logging.WARNING
        assert warned.getMessage().startswith("asynchronous replication: no standby")

    assert metric(pair.url(), "settled_replication_async") == 1
    assert metric(pair.url(), "settled_replication_standbys", sync_state="async") == 1

    result = check(pair.url())
    assert result.exit_code == 0, result.output
    line, warning = result.stdout.splitlines()
    assert said in line, line
    assert warning.startswith(
        "settled check: WARNING: asynchronous replication: no standby is synchronous "
        "(synchronous_standby_names ''); a failover to a standby can lose whole operations"
    ), warning


def test_asynchronous_replication_accepted_is_said_in_the_line_instead_of_a_warning(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    pair.synchronous("")
    accepted = (
        "standbys standby1 async): asynchronous, accepted (SETTLED_ASYNC_REPLICATION_ACCEPTED)"
    )
    (start,) = started(pair.url(), caplog, async_replication_accepted=True)
    assert accepted in start.getMessage()
    assert metric(pair.url(), "settled_replication_async") == 1  # the fact, accepted or not

    result = check(pair.url(), SETTLED_ASYNC_REPLICATION_ACCEPTED="true")
    assert result.exit_code == 0, result.output
    (line,) = result.stdout.splitlines()
    assert accepted in line, line


def test_a_synchronous_standby_starts_without_a_warning(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    pair.synchronous("standby1")
    try:
        (start,) = started(pair.url(), caplog)
        assert start.levelno == logging.INFO
        assert metric(pair.url(), "settled_replication_async") == 0
        assert metric(pair.url(), "settled_replication_standbys", sync_state="sync") == 1
        result = check(pair.url())
        assert result.exit_code == 0, result.output
        (line,) = result.stdout.splitlines()
        assert (
            "replication (synchronous_commit on, synchronous_standby_names 'standby1', "
            "standbys standby1 sync)" in line
        ), line
    finally:
        pair.synchronous("")


def test_check_names_each_host_of_a_multi_host_url_with_its_role(pair: Pair) -> None:
    dead = free_port()
    read_write = "target_session_attrs=read-write"

    refused = check(pair.url(pair.standby.port, dead, query=read_write))
    assert refused.exit_code == 1
    error = refused.stderr.strip().splitlines()[-1]
    assert error.startswith(
        "Error: [database_unreachable] no host of SETTLED_DATABASE_URL gave the session it "
        f"asks for (127.0.0.1:{pair.standby.port} standby; 127.0.0.1:{dead} unreachable ("
    ), error
    assert "Connection refused" in error, error

    passed = check(pair.url(dead, pair.standby.port, pair.primary.port, query=read_write))
    assert passed.exit_code == 0, passed.output
    hosts = [line for line in passed.stdout.splitlines() if "database host" in line]
    assert hosts[1:] == [
        f"settled check: database host 127.0.0.1:{pair.standby.port} standby",
        f"settled check: database host 127.0.0.1:{pair.primary.port} primary",
    ]
    assert hosts[0].startswith(f"settled check: database host 127.0.0.1:{dead} unreachable (")


def test_a_url_that_leads_to_a_standby_is_refused(pair: Pair) -> None:
    result = check(pair.url(pair.standby.port))
    assert result.exit_code == 1
    assert "[database_is_standby]" in result.stderr, result.stderr
