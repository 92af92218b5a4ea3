"""A Redis master, an optional replica and a Redis Sentinel watching them, all of a test's
own (throwaway ``redis-server`` processes and Debian's ``redis-sentinel`` on free loopback
ports, nothing kept on disk), for
the ``sentinel://`` broker; ``failover`` moves the master to the replica as an operator would
(``SENTINEL FAILOVER``)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import Any

import redis

from tests.support.services import (
    free_port,
    redis_answers,
    redis_binary,
    spawn_redis,
    system_binary,
    wait_for_own_redis,
    wait_until,
)

MASTER_NAME = "settled-broker"


class RedisSentinel:
    """``master`` (and ``replica`` if asked) as Redis servers, and one Sentinel on
    ``sentinel_port`` watching them under ``MASTER_NAME``. ``url`` is the broker URL: the
    Sentinel, and a second one where none listens (a Sentinel that is down: the others are
    asked)."""

    def __init__(self, *, replica: bool = False) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="settled-sentinel-"))
        self.binary = redis_binary()
        self.ports = [free_port()] + ([free_port()] if replica else [])
        self.sentinel_port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.url = (
            f"sentinel://127.0.0.1:{self.sentinel_port}/0;sentinel://127.0.0.1:{free_port()}/0"
        )

    def start(self) -> None:
        master = spawn_redis(self.binary, self.ports[0])
        self.procs.append(master)
        wait_for_own_redis(master, f"redis://127.0.0.1:{self.ports[0]}/0")
        for port in self.ports[1:]:
            replica = subprocess.Popen(
                [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--replicaof", "127.0.0.1", str(self.ports[0]),
                 "--dir", str(self.root)],  # where a replica writes the master's snapshot
                stdout=subprocess.DEVNULL,
            )  # fmt: skip
            self.procs.append(replica)
            wait_for_own_redis(replica, f"redis://127.0.0.1:{port}/0")
            if not wait_until(partial(self._linked, port)):
                raise RuntimeError("the replica did not link to its master")
        conf = self.root / "sentinel.conf"  # Sentinel rewrites its file: one of its own
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self.root}\n"
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.ports[0]} 1\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} 2000\n"
            f"sentinel failover-timeout {MASTER_NAME} 10000\n"
        )
        # Debian's redis-sentinel, as production runs it (.ci/run installs it)
        binary = system_binary("redis-sentinel")
        if binary is None:
            raise RuntimeError("no redis-sentinel: apt-get install redis-sentinel (.ci/run does)")
        sentinel = subprocess.Popen([str(binary), str(conf)], stdout=subprocess.DEVNULL)
        self.procs.append(sentinel)
        url = f"redis://127.0.0.1:{self.sentinel_port}"
        if not wait_until(lambda: sentinel.poll() is not None or redis_answers(url), 10):
            raise RuntimeError("the Sentinel did not answer")
        # Known replicas are what a failover can promote.
        if not wait_until(lambda: len(self.sentinel_replicas()) == len(self.ports) - 1, 30):
            raise RuntimeError("the Sentinel did not find the replica")

    def _linked(self, port: int) -> bool:
        client = self._client(port)
        try:
            return bool(client.info("replication").get("master_link_status") == "up")
        finally:
            client.close()

    def _client(self, port: int) -> redis.Redis[Any]:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)

    def sentinel_replicas(self) -> list[dict[str, Any]]:
        client = self._client(self.sentinel_port)
        try:
            found = client.sentinel_slaves(MASTER_NAME)  # type: ignore[no-untyped-call]
        except redis.RedisError:
            return []
        finally:
            client.close()
        return [r for r in found if r.get("is_slave") and not r.get("is_sdown")]

    def master_port(self) -> int:
        """The master's port as the Sentinel names it now."""
        client = self._client(self.sentinel_port)
        try:
            _, port = client.sentinel_get_master_addr_by_name(MASTER_NAME)  # type: ignore[no-untyped-call]
        finally:
            client.close()
        return int(port)

    def master(self) -> redis.Redis[Any]:
        """A client on the current master."""
        return self._client(self.master_port())

    def failover(self) -> int:
        """``SENTINEL FAILOVER``: promote the replica; the new master's port, once it serves
        as one and the Sentinel names it."""
        old = self.master_port()
        client = self._client(self.sentinel_port)
        try:
            client.execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
        finally:
            client.close()
        new = next(p for p in self.ports if p != old)

        def promoted() -> bool:
            try:
                role = self._client(new).info("replication")["role"]
                return self.master_port() == new and role == "master"
            except redis.RedisError:
                return False

        if not wait_until(promoted, 30):
            raise RuntimeError("the failover did not complete")
        return new

    def kill(self, port: int) -> None:
        """SIGKILL the Redis server on ``port`` (one of ``ports``)."""
        proc = self.procs[self.ports.index(port)]
        proc.kill()
        proc.wait(10)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.kill()
            with suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self.procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)
