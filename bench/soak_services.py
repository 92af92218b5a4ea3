"""The fault soak's environment (``bench/soak.py``): its state, the services it starts
(PostgreSQL, Redis, the simulator, workers and beats), the supervisor that restarts them, and
their shutdown."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import psycopg
from sqlalchemy.engine import make_url

from bench import soak_producer
from bench.soak_plan import TENANTS, orders, secret
from bench.soak_procs import DATABASE, ROOT, Service, Timeline, libpq, popen_alive
from outbox.kinds import default_registry
from settled.simulator import SimulatorControl
from tests.support.services import (
    PostgresCluster,
    free_port,
    redis_binary,
    spawn_redis,
    wait_for_own_redis,
    wait_until,
)


@dataclass
class Recovery:
    """Operations a worker held a lease on when it was killed or stopped."""

    event: dict[str, Any]
    held: list[int]
    db_time: datetime


@dataclass
class SoakBase:
    """The soak's state and its processes; the chaos loop and the phases are subclasses."""

    args: argparse.Namespace
    out: Path
    seed: int
    t0: float = field(default_factory=time.monotonic)
    services: dict[str, Service] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    recoveries: list[Recovery] = field(default_factory=list)
    stopped_as: dict[int, str] = field(default_factory=dict)  # stop's pick -> group stopped
    files: list[IO[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.timeline = Timeline(self.out / "timeline.jsonl", self.t0)
        self.fingerprint_key = secret(self.seed, "fingerprint-key")
        self.idempotency_secret = secret(self.seed, "idempotency-secret")
        self.api_keys = {t: "sk_test_" + secret(self.seed, f"api-key-{t}", 24) for t in TENANTS}
        self.cluster: PostgresCluster | None = None
        self.redis_port = free_port()
        self.broker_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.sim_port = free_port()
        self.sim_url = f"http://127.0.0.1:{self.sim_port}"
        self.simulator: subprocess.Popen[bytes] | None = None
        self.control: SimulatorControl | None = None
        self.supervising = threading.Event()
        self.supervisor: threading.Thread | None = None
        self.hold_seconds = self.args.downstream_timeout + 2.0
        self._last_print = time.monotonic()

    # -- environment and processes ------------------------------------------------------

    @property
    def database_url(self) -> str:
        assert self.cluster is not None
        url = make_url(self.cluster.url).set(drivername="postgresql+psycopg", database=DATABASE)
        return url.render_as_string(hide_password=False)

    def env(self, **extra: str) -> dict[str, str]:
        """A child's environment: the product's defaults but for what must be said.

        The lease, sweep and reconcile periods are the product's defaults (not set here).
        ``SETTLED_DOWNSTREAM_TIMEOUT`` is shorter than the default 10 s: a send is sent with
        the rest of its batch and the batch's outcomes are written together, so one held
        ``commit_then_timeout`` response holds up to 20 operations for the whole client
        timeout; at 10 s on this 2-core box the soak would measure mostly that. 3 s is still
        far above the simulator's answer time under load.
        """
        env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
        env.update(
            SETTLED_DATABASE_URL=self.database_url,
            SETTLED_BROKER_URL=self.broker_url,
            SETTLED_DOWNSTREAM_URL=self.sim_url,
            SETTLED_DOWNSTREAM_API_KEYS=json.dumps(self.api_keys),
            SETTLED_DOWNSTREAM_TIMEOUT=str(self.args.downstream_timeout),
            # The downstream is the simulator, which refuses requests past their deadline
            # (``--unfenced``: declared as a downstream that does not, each kind's default).
            SETTLED_DOWNSTREAM_CONTRACTS=json.dumps(
                {
                    name: {"enforces_deadline": not self.args.unfenced}
                    for name in default_registry().names()
                }
            ),
            SETTLED_FINGERPRINT_KEYS=json.dumps({"v1": self.fingerprint_key}),
            SETTLED_IDEMPOTENCY_SECRET=self.idempotency_secret,
            SETTLED_LOG_LEVEL=self.args.loglevel,
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
        )
        env.update(extra)
        return env

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - closed at the end
        self.files.append(log)
        log.write(f"--- started at {self.timeline.now()} s\n".encode())
        log.flush()
        return subprocess.Popen(
            argv,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.out,
            start_new_session=True,  # its own process group: killed and stopped as a whole
        )

    def add(
        self, name: str, starter: Callable[[Service], int], alive: Callable[[Service], bool]
    ) -> Service:
        svc = Service(name, starter, alive)
        self.services[name] = svc
        svc.start()
        self.timeline.record("start", name, svc.pid)
        return svc

    def start_postgres(self, svc: Service) -> int:
        assert self.cluster is not None
        self.cluster.start()
        pid = self.cluster.postmaster_pid()
        assert pid is not None
        return pid

    def start_redis(self, svc: Service) -> int:
        svc.proc = spawn_redis(redis_binary(), self.redis_port)
        wait_for_own_redis(svc.proc, self.broker_url)
        return svc.proc.pid

    def worker_starter(self, name: str) -> Callable[[Service], int]:
        def start(svc: Service) -> int:
            svc.proc = self.spawn(
                name,
                [sys.executable, "-m", "settled.cli", "worker", "--pool", "prefork",
                 "--concurrency", str(self.args.concurrency), "--no-beat",
                 f"--hostname={name}@%h", "--loglevel", self.args.loglevel],
                self.env(),
            )  # fmt: skip
            return svc.proc.pid

        return start

    def beat_starter(self, name: str) -> Callable[[Service], int]:
        schedule = self.out / "beat" / name / "celerybeat-schedule"

        def start(svc: Service) -> int:
            svc.proc = self.spawn(
                name,
                [sys.executable, "-m", "settled.cli", "beat", "--loglevel", self.args.loglevel],
                self.env(SETTLED_BEAT_SCHEDULE_FILE=str(schedule)),
            )
            return svc.proc.pid

        return start

    def start_services(self) -> None:
        cluster = self.cluster = PostgresCluster()
        self.add("postgres", self.start_postgres, lambda _: cluster.postmaster_pid() is not None)
        with psycopg.connect(cluster.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{DATABASE}"')
        upgraded = subprocess.run(
            [sys.executable, "-m", "settled.cli", "db", "upgrade"],
            env=self.env(),
            capture_output=True,
            text=True,
            check=False,
        )
        if upgraded.returncode != 0:
            raise RuntimeError(f"settled db upgrade failed: {upgraded.stderr[-2000:]}")
        with psycopg.connect(libpq(self.database_url), autocommit=True) as conn:
            conn.execute(soak_producer.BUSINESS_TABLE)
        self.timeline.record("migrated", "postgres")

        self.add("redis", self.start_redis, popen_alive)

        tenants = " ".join(f"{t}={k}" for t, k in self.api_keys.items())
        self.simulator = self.spawn(
            "simulator",
            [sys.executable, "-m", "settled.cli", "simulator", "--test-mode",
             "--ledger", self.args.sim_ledger, "--port", str(self.sim_port)],
            self.env(SETTLED_SIMULATOR_TENANTS=tenants),
        )  # fmt: skip
        self.timeline.record("start", "simulator", self.simulator.pid)
        self.control = SimulatorControl(self.sim_url, timeout=30.0)
        if not wait_until(self._simulator_answers, 60):
            raise RuntimeError("the simulator did not answer within 60 s")
        for tenant, order_id, amount, closed in orders():
            self.control.create_order(tenant, order_id, amount, closed=closed)

        for name in ("w1", "w2"):
            self.add(name, self.worker_starter(name), popen_alive)
        for name in ("b1", "b2"):
            self.add(name, self.beat_starter(name), popen_alive)
        self.supervisor = threading.Thread(target=self.supervise, name="supervisor", daemon=True)
        self.supervisor.start()

    def _simulator_answers(self) -> bool:
        assert self.simulator is not None and self.control is not None
        if self.simulator.poll() is not None:
            raise RuntimeError(f"the simulator exited with {self.simulator.returncode}")
        try:
            self.control.faults()
            return True
        except Exception:
            return False

    # -- the supervisor -----------------------------------------------------------------

    def supervise(self) -> None:
        """Restart whatever died, ``--restart-delay`` seconds after it was seen down."""
        while not self.supervising.wait(0.1):
            for svc in list(self.services.values()):
                with self.lock:
                    self._look_after(svc)

    def _look_after(self, svc: Service) -> None:
        if svc.stopped or svc.running():
            return
        now = time.monotonic()
        if svc.down_since is None:
            svc.down_since = now
            if not svc.killed:
                code = svc.proc.returncode if svc.proc is not None else None
                self.timeline.record("exited", svc.name, svc.pid, returncode=code)
            return
        if now - svc.down_since < self.args.restart_delay:
            return
        try:
            svc.start()
        except Exception as exc:
            svc.down_since = now  # try again a delay later
            self.timeline.record("restart_failed", svc.name, error=type(exc).__name__)
            return
        self.timeline.record("restart", svc.name, svc.pid)

    def stop_processes(self) -> None:
        """Stop the supervisor, then workers and beats (warm shutdown, SIGKILL if they hang)."""
        self.supervising.set()
        if self.supervisor is not None:
            self.supervisor.join(30)
        with self.lock:
            groups = [s for n, s in self.services.items() if n[0] in "wb" and s.proc is not None]
            for svc in groups:
                assert svc.proc is not None
                with suppress(ProcessLookupError):
                    os.killpg(svc.proc.pid, signal.SIGCONT)
                    os.killpg(svc.proc.pid, signal.SIGTERM)
            for svc in groups:
                assert svc.proc is not None
                with suppress(subprocess.TimeoutExpired):
                    svc.proc.wait(30)
                with suppress(ProcessLookupError):
                    os.killpg(svc.proc.pid, signal.SIGKILL)
                svc.proc.wait(10)
        self.timeline.record("stopped", "workers")

    def close(self) -> None:
        """Everything down and gone (also after a failure)."""
        self.supervising.set()
        for svc in self.services.values():
            if svc.proc is not None and svc.name != "redis":
                with suppress(ProcessLookupError):
                    os.killpg(svc.proc.pid, signal.SIGCONT)
                    os.killpg(svc.proc.pid, signal.SIGKILL)
        if self.control is not None:
            self.control.close()
        if self.simulator is not None and self.simulator.poll() is None:
            self.simulator.terminate()
            try:
                self.simulator.wait(10)
            except subprocess.TimeoutExpired:
                self.simulator.kill()
        redis_svc = self.services.get("redis")
        if redis_svc is not None and redis_svc.proc is not None and redis_svc.proc.poll() is None:
            redis_svc.proc.kill()
            redis_svc.proc.wait(10)
        if self.cluster is not None:
            if self.args.keep_db:
                self.cluster.stop("fast")
                print(f"  the database is kept in {self.cluster.root}")
            else:
                self.cluster.close()
        for f in self.files:
            f.close()
        self.timeline.close()
