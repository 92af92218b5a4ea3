"""A throwaway PgBouncer (the system's ``pgbouncer``: Debian's package) of a test's own, in
front of the test PostgreSQL, in a pool mode of the test's choice; its own configuration and
folder, a free loopback port, run as ``postgres`` when the tests run as root (PgBouncer
refuses to run as root)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from sqlalchemy.engine import make_url

from tests.support.services import (
    end_process,
    free_port,
    pg_answers,
    system_binary,
    wait_until,
)


class PgBouncer:
    """A PgBouncer of the test's own in front of ``database_url``'s server, in ``pool_mode``
    (``session`` or ``transaction``), ``pool_size`` server connections at most. ``url`` is the
    SQLAlchemy URL of the database through it. ``kill`` and ``start`` take it away and bring it
    back on the same port, as a restart of the pooler under load would."""

    def __init__(self, database_url: str, pool_mode: str, pool_size: int = 10) -> None:
        self.binary = system_binary("pgbouncer") or Path("/usr/sbin/pgbouncer")
        if not self.binary.exists():
            raise RuntimeError("no pgbouncer: apt-get install pgbouncer (.ci/run does)")
        server = make_url(database_url)
        host = server.host or str(server.query.get("host", "127.0.0.1"))
        self.root = Path(tempfile.mkdtemp(prefix="settled-pgbouncer-"))
        self.port = port = free_port()
        user = server.username or "postgres"
        (self.root / "users.txt").write_text(f'"{user}" ""\n')
        (self.root / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={host} port={server.port or 5432}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.root / 'users.txt'}\n"
            f"pool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\nmax_client_conn = 200\n"
            f"logfile = {self.root / 'log'}\npidfile = {self.root / 'pid'}\n"
        )
        self.run_as: list[str] = []
        if os.geteuid() == 0:
            self.run_as = ["runuser", "-u", "postgres", "--"]
            shutil.chown(self.root, "postgres", "postgres")
            for f in self.root.iterdir():
                shutil.chown(f, "postgres", "postgres")
        self.libpq = f"postgresql://{user}@127.0.0.1:{port}/{server.database}"
        self.url = server.set(host="127.0.0.1", port=port, query={}).render_as_string(
            hide_password=False
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        proc = self.proc = subprocess.Popen(
            [*self.run_as, str(self.binary), str(self.root / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if not wait_until(lambda: proc.poll() is not None or pg_answers(self.libpq), 15):
            raise RuntimeError("pgbouncer did not answer")
        if proc.poll() is not None:
            log = (self.root / "log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"pgbouncer exited with {proc.returncode}: {log}")

    def kill(self) -> None:
        """Gone at once (SIGKILL): every client connection cut, every transaction through it
        with an outcome its client does not know."""
        if self.proc is not None:
            pid = (self.root / "pid").read_text().strip() if (self.root / "pid").exists() else ""
            self.proc.kill()  # runuser; PgBouncer itself is its child
            if pid.isdigit():
                with suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None
            wait_until(lambda: not pg_answers(self.libpq), 10)
            (self.root / "pid").unlink(missing_ok=True)

    def close(self) -> None:
        if self.proc is not None:
            end_process(self.proc)
            self.proc = None
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def pgbouncer(database_url: str, pool_mode: str, pool_size: int = 10) -> Iterator[str]:
    """The SQLAlchemy URL of ``database_url``'s database through a started ``PgBouncer``."""
    bouncer = PgBouncer(database_url, pool_mode, pool_size)
    try:
        bouncer.start()
        yield bouncer.url
    finally:
        bouncer.close()
