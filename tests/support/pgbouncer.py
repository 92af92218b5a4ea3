"""A throwaway PgBouncer (the system's ``pgbouncer``: Debian's package) of a test's own, in
front of the test PostgreSQL, in a pool mode of the test's choice; its own configuration and
folder, a free loopback port, run as ``postgres`` when the tests run as root (PgBouncer
refuses to run as root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy.engine import make_url

from tests.support.services import (
    end_process,
    free_port,
    pg_answers,
    system_binary,
    wait_until,
)


@contextmanager
def pgbouncer(database_url: str, pool_mode: str, pool_size: int = 10) -> Iterator[str]:
    """The SQLAlchemy URL of ``database_url``'s database through a PgBouncer in ``pool_mode``
    (``session`` or ``transaction``), ``pool_size`` server connections at most."""
    binary = system_binary("pgbouncer") or Path("/usr/sbin/pgbouncer")
    if not binary.exists():
        raise RuntimeError("no pgbouncer: apt-get install pgbouncer (.ci/run does)")
    server = make_url(database_url)
    host = server.host or str(server.query.get("host", "127.0.0.1"))
    root = Path(tempfile.mkdtemp(prefix="settled-pgbouncer-"))
    port = free_port()
    user = server.username or "postgres"
    (root / "users.txt").write_text(f'"{user}" ""\n')
    (root / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={host} port={server.port or 5432}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {root / 'users.txt'}\n"
        f"pool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\nmax_client_conn = 200\n"
        f"logfile = {root / 'log'}\npidfile = {root / 'pid'}\n"
    )
    run_as = []
    if os.geteuid() == 0:
        run_as = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, "postgres", "postgres")
        for f in root.iterdir():
            shutil.chown(f, "postgres", "postgres")
    proc = subprocess.Popen(
        [*run_as, str(binary), str(root / "pgbouncer.ini")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    bounced = server.set(host="127.0.0.1", port=port, query={})
    try:
        libpq = f"postgresql://{user}@127.0.0.1:{port}/{server.database}"
        if not wait_until(lambda: proc.poll() is not None or pg_answers(libpq), 15):
            raise RuntimeError("pgbouncer did not answer")
        if proc.poll() is not None:
            log = (root / "log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"pgbouncer exited with {proc.returncode}: {log}")
        yield bounced.render_as_string(hide_password=False)
    finally:
        end_process(proc)
        shutil.rmtree(root, ignore_errors=True)
