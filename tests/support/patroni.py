"""A Patroni pair of the test's own: one etcd member and two PostgreSQL 15 nodes under
Patroni 3 (Debian's ``patroni`` and ``etcd-server``), with synchronous replication
(``synchronous_mode``), as docs/production.md asks for. ``kill`` takes a node's host away
(Patroni and its PostgreSQL killed at once, no shutdown); ``start`` brings one back.

The DCS timings are short so that a test sees a failover in seconds: a leader key lives
``TTL`` seconds (6; Patroni checks every second and gives a DCS call 2 s), so the standby
promotes itself about 6 s after the leader's host is gone.

Every process is a child of the test, in a session of its own, and is killed by ``stop``; the
data lives in a temporary folder deleted with it. Run as root, Patroni and PostgreSQL run as
the ``postgres`` user (PostgreSQL refuses root).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

from tests.support.services import free_port, postgres_bin_dir
from tests.support.simtools import wait_until

SCOPE = "settled-test"
TTL, LOOP_WAIT, RETRY_TIMEOUT = 6, 1, 2


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:  # CI installs it (.ci/run); a test that needs it fails, never skips
        raise RuntimeError(f"{name} is not installed (Debian: apt-get install {name})")
    return path


@dataclass
class Node:
    name: str
    pg_port: int
    rest_port: int
    data: Path
    config: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    @property
    def dsn(self) -> str:
        """A libpq URL of this node alone (its maintenance database)."""
        return f"postgresql://postgres@127.0.0.1:{self.pg_port}/postgres"

    def status(self) -> dict[str, Any] | None:
        """Patroni's own view of this node (``GET /patroni``), None while it does not answer."""
        try:
            return httpx.get(f"{self.api}/patroni", timeout=2).json()  # type: ignore[no-any-return]
        except (httpx.HTTPError, ValueError):
            return None

    def role(self) -> str | None:
        status = self.status()
        return None if status is None else str(status.get("role"))


@dataclass
class PatroniPair:
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="settled-patroni-")))
    nodes: list[Node] = field(default_factory=list)
    etcd: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            shutil.chown(self.root, "postgres", "postgres")
        self.etcd_port, self.peer_port = free_port(), free_port()
        for name in ("n1", "n2"):
            node = Node(
                name=name,
                pg_port=free_port(),
                rest_port=free_port(),
                data=self.root / f"data-{name}",
                config=self.root / f"{name}.yml",
                log=self.root / f"{name}.log",
            )
            node.config.write_text(json.dumps(self._config(node), indent=2))  # YAML reads JSON
            self.nodes.append(node)

    def _config(self, node: Node) -> dict[str, Any]:
        bin_dir = postgres_bin_dir()
        return {
            "scope": SCOPE,
            "name": node.name,
            "log": {"level": "INFO"},
            "restapi": {"listen": f"127.0.0.1:{node.rest_port}",
                        "connect_address": f"127.0.0.1:{node.rest_port}"},
            "etcd3": {"hosts": f"127.0.0.1:{self.etcd_port}"},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL, "loop_wait": LOOP_WAIT, "retry_timeout": RETRY_TIMEOUT,
                    "maximum_lag_on_failover": 1048576,
                    # A commit returns once the synchronous standby has it: a failover to it
                    # loses no transaction the app saw committed.
                    "synchronous_mode": True,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "parameters": {"fsync": "off", "max_wal_senders": 5,
                                       "max_replication_slots": 5},
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
                "pg_hba": ["local all all trust", "host all all 127.0.0.1/32 trust",
                           "host replication all 127.0.0.1/32 trust"],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.pg_port}",
                "connect_address": f"127.0.0.1:{node.pg_port}",
                "data_dir": str(node.data),
                "bin_dir": str(bin_dir),
                "pgpass": str(self.root / f"pgpass-{node.name}"),
                "authentication": {"superuser": {"username": "postgres"},
                                   "replication": {"username": "postgres"},
                                   "rewind": {"username": "postgres"}},
                "parameters": {"unix_socket_directories": str(self.root)},
            },
        }  # fmt: skip

    # -- the processes ----------------------------------------------------------------------

    def start(self) -> None:
        """etcd, then both nodes, until one leads and the other streams as its synchronous
        standby."""
        with open(self.root / "etcd.log", "wb") as out:  # the child keeps its own copy
            self.etcd = subprocess.Popen(
                [_binary("etcd"), "--name", "e0", "--data-dir", str(self.root / "etcd"),
                 "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                 "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                 "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                 "--initial-cluster", f"e0=http://127.0.0.1:{self.peer_port}"],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        wait_until(self._etcd_answers, 30, "etcd to answer")
        for node in self.nodes:  # one bootstraps the cluster, the other waits and copies it
            self.start_node(node)
        wait_until(self.synchronous, 90, "a leader and a synchronous standby")

    def _etcd_answers(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.etcd_port}/version", timeout=1).is_success
        except httpx.HTTPError:
            return False

    def start_node(self, node: Node) -> None:
        user = "postgres" if self._as_postgres else None
        with open(node.log, "ab") as out:  # the child keeps its own copy
            node.proc = subprocess.Popen(
                [_binary("patroni"), str(node.config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.root,
                user=user,
                group=user,
            )

    def kill(self, node: Node) -> None:
        """The node's host gone: its PostgreSQL and Patroni killed at once (no shutdown, no
        demotion, the leader key left to expire); returns once its port refuses."""
        postmaster = self._postmaster(node)
        if postmaster is not None:  # first: no commit lands once this returns
            try:  # Patroni starts it in a session of its own
                os.killpg(postmaster, signal.SIGKILL)
            except ProcessLookupError:
                with suppress(ProcessLookupError):
                    os.kill(postmaster, signal.SIGKILL)
        if node.proc is not None:
            with suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGKILL)
            node.proc.wait(10)
            node.proc = None
        if postmaster is not None:
            wait_until(lambda: not _alive(postmaster), 10, "the killed node's postmaster to end")
        wait_until(lambda: not _answers(node), 10, "the killed node's port to refuse")

    @staticmethod
    def _postmaster(node: Node) -> int | None:
        try:
            first = (node.data / "postmaster.pid").read_text().split("\n", 1)[0].strip()
        except OSError:
            return None
        return int(first) if first.isdigit() and _alive(int(first)) else None

    def stop(self) -> None:
        for node in self.nodes:
            self.kill(node)
        if self.etcd is not None:
            self.etcd.kill()
            self.etcd.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)

    # -- what the cluster says --------------------------------------------------------------

    def members(self) -> list[dict[str, Any]]:
        """``GET /cluster`` from a node that answers (empty while none does)."""
        for node in self.nodes:
            if node.proc is None:
                continue
            try:
                return list(httpx.get(f"{node.api}/cluster", timeout=2).json()["members"])
            except (httpx.HTTPError, ValueError, KeyError):
                continue
        return []

    def synchronous(self) -> bool:
        """A leader and a synchronous standby streaming with no lag."""
        roles = {
            m.get("role"): m for m in self.members() if m.get("state") in ("running", "streaming")
        }
        return "leader" in roles and "sync_standby" in roles

    def leader(self) -> Node:
        names = [m["name"] for m in self.members() if m.get("role") == "leader"]
        assert len(names) == 1, self.members()
        return next(n for n in self.nodes if n.name == names[0])

    def url(self, database: str) -> str:
        """The URL Settled is given: both hosts, the one that takes writes chosen at connect
        (libpq's ``target_session_attrs=read-write``, docs/production.md)."""
        hosts = "&".join(f"host=127.0.0.1:{n.pg_port}" for n in self.nodes)
        return f"postgresql+psycopg://postgres@/{database}?{hosts}&target_session_attrs=read-write"

    def logs(self) -> str:
        return "\n".join(
            f"--- {n.name}\n{n.log.read_text(errors='replace')[-3000:]}"
            for n in self.nodes
            if n.log.exists()
        )


def _answers(node: Node) -> bool:
    try:
        psycopg.connect(node.dsn, connect_timeout=1).close()
    except psycopg.OperationalError:
        return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
