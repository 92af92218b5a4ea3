"""Live traffic and open-loop latency, for Settled and its peers alike.

Both phases run P producer processes (``bench/peers/feed.py``, each with the interpreter of the
system's environment) that commit one refund per transaction and hand it to the system while
its worker runs: never a paused consumer and a backlog.

* live (``measure_live``): closed loop, each producer as fast as it can for ``seconds``; the
  rate is the refunds that reached their receipt (Settled: ``succeeded``) in the window the
  producers were live, counted at its start and at its end, over its length; commit-to-receipt
  p50/p99 of the refunds committed in the window;
* open loop (``measure_open``): operation k arrives at ``t0 + k / rate`` whatever has
  completed; commit-to-receipt p50/p99 of every refund; CPU per refund of the worker's process
  tree (``/proc``, from ``t0`` to the last receipt) and, apart, of the producers; the worker's
  write transactions per refund (``xact_commit`` as ``phases/drain.py`` reads it, minus the
  benchmark's own commits, counted exactly).

Receipt times are stamped by the statement that writes the receipt (``RECEIPT_STAMP``), not
seen through NOTIFY: notifying commits are serialised by PostgreSQL, and a listening backend
commits a transaction of its own for each notification it takes in, which would count as the
worker's. Each system is judged after the phase: one effect at the
simulator per idempotency key, one receipt per refund, nothing missing.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg
import redis

from bench.noop_app import stock_app
from bench.peers.schema import NAMES, TABLES
from bench.phases.common import (
    API_KEY,
    ROOT,
    TENANT,
    Broker,
    Services,
    libpq,
    pct,
    poll,
    settled_commits,
    start_settled_worker,
    wait_worker,
)

# -- the systems -----------------------------------------------------------------------------


@dataclass
class System:
    """What a phase needs to drive one system."""

    name: str  # the feed's name (``bench.peers.feed.SYSTEMS``)
    label: str  # in the table
    python: str = sys.executable  # the interpreter of its environment
    peer: str | None = None  # the ``peer`` column of its rows (None: Settled or the no-op)
    env: dict[str, str] = field(default_factory=dict)  # more environment for its processes

    @property
    def has_receipts(self) -> bool:
        return self.name != "noop"


SETTLED = System("settled", "Settled")
NOOP = System("noop", "stock Celery no-op")
CELERY_SAFE = System("celery_safe", "plain Celery safe", peer=NAMES["celery_safe"])


def _feed_cfg(svc: Services, system: System) -> dict[str, Any]:
    e = svc.endpoints
    return {
        "endpoints": {"db_url": e.db_url, "broker_url": e.broker_url, "sim_url": e.sim_url,
                      "doorbell": e.doorbell, "claim_batch": e.claim_batch},
        "db_url": e.db_url, "broker_url": e.broker_url, "sim_url": e.sim_url,
        "api_key": API_KEY, "tenant": TENANT,
    }  # fmt: skip


def _env(svc: Services, system: System) -> dict[str, str]:
    env = svc.env()
    env["BENCH_API_KEY"] = API_KEY
    env.update(system.env)
    return env


def start_worker(svc: Services, system: System, tag: str) -> subprocess.Popen[bytes]:
    name = f"{system.name}-worker-{tag}"
    if system.name == "settled":
        return start_settled_worker(svc, name)
    if system.name == "noop":
        argv = [sys.executable, "-m", "bench.noop_app", "--stock"]
    elif system.name == "celery_safe":
        argv = [sys.executable, "-m", "bench.peers.celery_safe"]
    else:
        argv = [system.python, "-m", f"bench.peers.{system.name}_peer", "worker"]
    argv += [
        f"--concurrency={svc.concurrency}",
        f"--pool={svc.pool}",
        f"--hostname=bench-{name}@%h",
    ]
    log = open(svc.workdir / f"{name}.log", "wb")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(argv, env=_env(svc, system), stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT)  # fmt: skip
    log.close()
    svc.procs.append(proc)
    return proc


def wait_ready(svc: Services, system: System, proc: subprocess.Popen[bytes]) -> None:
    if system.name in ("settled", "noop", "celery_safe"):
        from bench.peers.celery_safe import make_app

        app = (
            stock_app(svc.broker_url) if system.name != "celery_safe" else make_app(svc.broker_url)
        )
        try:
            wait_worker(app, proc)
        finally:
            app.close()
    # The other peers' workers need nothing to be ready: a job waits for them in the database.


def clear_broker(svc: Services) -> None:
    """The bench's Redis db emptied: what an earlier phase's worker left queued (its beat's
    sweeps, say) is never handed to the next system's worker."""
    client = redis.Redis.from_url(svc.broker_url)
    try:
        client.flushdb()
    finally:
        client.close()


def warmed(proc: subprocess.Popen[bytes], done: Done, warm: int) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"the worker exited (rc {proc.returncode}); see its log")
    return done.count(warm) >= warm


class Done:
    """How many refunds of a system have their receipt: one autocommit statement per call."""

    def __init__(self, svc: Services, system: System) -> None:
        self.system = system
        self.conn = psycopg.connect(libpq(svc.db_url), autocommit=True)
        self.broker = Broker(svc.broker_url) if system.name == "noop" else None
        self.commits = 0
        self.offset = 0
        if self.broker is None:  # receipts of the phases before, all made before this one
            self.offset = self.count()

    def count(self, published: int = 0) -> int:
        """Refunds with a receipt (the no-op: ``published`` minus what is still queued)."""
        if self.broker is not None:
            return published - self.broker.pending()
        self.commits += 1
        if self.system.peer is None:
            sql, args = "SELECT count(*) FROM operations WHERE state = 'succeeded'", ()
        else:
            sql, args = "SELECT count(*) FROM peer_receipts WHERE peer = %s", (self.system.peer,)
        row = self.conn.execute(sql, args).fetchone()
        return (int(row[0]) if row else 0) - self.offset

    def close(self) -> None:
        self.conn.close()
        if self.broker is not None:
            self.broker.close()


#: When each receipt was written: Settled's ``succeeded`` update stamps a column the bench
#: adds to its throwaway database (a BEFORE trigger: no statement, no commit of its own); a
#: peer's receipt row has its ``at``. Both ``clock_timestamp()`` in the statement that writes
#: the receipt, so both leave out that commit's own flush alike.
RECEIPT_STAMP = """
ALTER TABLE operations ADD COLUMN IF NOT EXISTS bench_receipt_at timestamptz;
CREATE OR REPLACE FUNCTION bench_stamp_receipt() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.bench_receipt_at := clock_timestamp();
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS bench_stamp_receipt ON operations;
CREATE TRIGGER bench_stamp_receipt BEFORE UPDATE OF state ON operations FOR EACH ROW
    WHEN (NEW.state = 'succeeded' AND OLD.state <> 'succeeded')
    EXECUTE FUNCTION bench_stamp_receipt();
"""


def prepare(svc: Services, system: System) -> None:
    """The peers' tables and the receipt stamp, and a peer's own schema (idempotent)."""
    with psycopg.connect(libpq(svc.db_url), autocommit=True) as conn:
        conn.execute(TABLES)
        conn.execute(RECEIPT_STAMP)
    if system.name in ("procrastinate", "dbos"):
        done = subprocess.run(
            [system.python, "-m", f"bench.peers.{system.name}_peer", "schema"],
            env=_env(svc, system), cwd=ROOT, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{system.label}: its schema failed:\n{done.stderr[-3000:]}")


def receipt_times(db_url: str, system: System, ids: list[int]) -> dict[int, float]:
    """Wall clock (epoch seconds) at which each refund's receipt was written."""
    if system.peer is None:
        sql = "SELECT id, extract(epoch FROM bench_receipt_at) FROM operations WHERE id = ANY(%s)"
    else:
        sql = "SELECT refund_id, extract(epoch FROM min(at)) FROM peer_receipts" \
              " WHERE refund_id = ANY(%s) GROUP BY refund_id"  # fmt: skip
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        return {int(i): float(t) for i, t in conn.execute(sql, (ids,)).fetchall() if t}


def drop_stamp(db_url: str) -> None:
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute("DROP TRIGGER IF EXISTS bench_stamp_receipt ON operations")


# -- the producer processes ------------------------------------------------------------------


@dataclass
class Fed:
    ids: list[int] = field(default_factory=list)
    committed: dict[int, float] = field(default_factory=dict)
    late_ms: list[float] = field(default_factory=list)
    commits: int = 0
    cpu: float = 0.0  # CPU seconds of the producers from t0 to their last commit
    last: float = 0.0  # the last commit's wall clock


class Feeds:
    """P producer processes of ``system`` (``bench/peers/feed.py``)."""

    def __init__(self, svc: Services, system: System, producers: int, **loop: Any) -> None:
        base = _feed_cfg(svc, system)
        self.procs = []
        for index in range(producers):
            cfg = {**base, **loop, "index": index, "producers": producers}
            log = open(svc.workdir / f"{system.name}-feed-{index}.log", "ab")  # noqa: SIM115
            self.procs.append(subprocess.Popen(
                [system.python, "-m", "bench.peers.feed", system.name, json.dumps(cfg)],
                env=_env(svc, system), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log, cwd=ROOT, text=True,
            ))  # fmt: skip
            log.close()

    def _read(self, proc: subprocess.Popen[str], key: str) -> Any:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("FEED "):
                message = json.loads(line[5:])
                if key in message:
                    return message
        raise RuntimeError(f"a producer process of the bench exited (rc {proc.wait()})")

    def ready(self) -> list[int]:
        return [i for p in self.procs for i in self._read(p, "ready")["ready"]]

    def go(self, t0: float) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(json.dumps({"t0": t0}) + "\n")
            p.stdin.flush()

    def join(self) -> Fed:
        fed = Fed()
        for p in self.procs:
            got = self._read(p, "ids")
            fed.ids += got["ids"]
            fed.committed.update(zip(got["ids"], got["committed"], strict=True))
            fed.late_ms += got["late_ms"]
            fed.commits += got["commits"]
            fed.cpu += got["cpu"]
            p.wait(30)
        fed.last = max(fed.committed.values(), default=0.0)
        return fed

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


# -- CPU of a process tree -------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu(root: int) -> float:
    """CPU seconds (user + system, reaped children's included) of ``root`` and every process
    below it, from ``/proc``."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry)
        parent[pid] = int(fields[1])
        ticks[pid] = sum(int(x) for x in fields[11:15])
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += [c for c, p in parent.items() if p == pid]
    return total / _TICK


# -- judging ---------------------------------------------------------------------------------


@dataclass
class Judgement:
    refunds: int
    effects: int  # business effects at the simulator for these refunds' keys
    duplicated: int  # keys with more than one effect
    receipts: int
    missing: int  # refunds with no receipt (or no effect)
    extra: int  # refunds with more than one receipt

    @property
    def correct(self) -> bool:
        return (
            self.refunds > 0
            and not (self.duplicated or self.missing or self.extra)
            and (self.effects == self.refunds)
        )

    def __str__(self) -> str:
        verdict = "correct" if self.correct else "NOT correct"
        return (f"{self.refunds} refunds, {self.effects} effects at the simulator "
                f"({self.duplicated} keys twice), {self.receipts} receipts ({self.missing} "
                f"missing, {self.extra} refunds with more than one): {verdict}")  # fmt: skip


def judge(svc: Services, system: System, ids: list[int]) -> Judgement:
    """One effect at the simulator and one receipt per refund, for the refunds ``ids``."""
    from settled.simulator import SimulatorControl

    with psycopg.connect(libpq(svc.db_url), autocommit=True) as conn:
        if system.peer is None:
            rows = conn.execute(
                "SELECT id, idempotency_key, (state = 'succeeded' AND receipt IS NOT NULL)::int"
                " FROM operations WHERE id = ANY(%s)", (ids,),
            ).fetchall()  # fmt: skip
        else:
            rows = conn.execute(
                "SELECT r.id, r.idempotency_key, count(c.id) FROM peer_refunds r"
                " LEFT JOIN peer_receipts c ON c.refund_id = r.id"
                " WHERE r.id = ANY(%s) GROUP BY r.id, r.idempotency_key", (ids,),
            ).fetchall()  # fmt: skip
    with SimulatorControl(svc.sim_url, timeout=30.0) as control:
        effects: dict[str, int] = {}
        for e in control.ledger()["effects"]:
            effects[e["idempotency_key"]] = effects.get(e["idempotency_key"], 0) + 1
    keys = [key for _, key, _ in rows]
    return Judgement(
        refunds=len(ids),
        effects=sum(effects.get(k, 0) for k in keys),
        duplicated=sum(effects.get(k, 0) > 1 for k in keys),
        receipts=sum(int(n) for _, _, n in rows),
        missing=len(ids) - len(rows) + sum(int(n) == 0 or effects.get(k, 0) == 0
                                           for _, k, n in rows),
        extra=sum(int(n) > 1 for _, _, n in rows),
    )  # fmt: skip


# -- the phases ------------------------------------------------------------------------------


@dataclass
class LiveResult:
    system: System
    rate: float  # refunds that reached their receipt per second, producers live
    committed_rate: float  # refunds the producers committed per second
    latency_ms: list[float]  # commit → receipt of the refunds committed in the window
    judgement: Judgement | None
    window: float

    @property
    def p50(self) -> float:
        return statistics.median(self.latency_ms) if self.latency_ms else float("nan")

    @property
    def p99(self) -> float:
        return pct(self.latency_ms, 0.99) if self.latency_ms else float("nan")


def measure_live(
    svc: Services, system: System, *, producers: int, seconds: float, warm: int
) -> LiveResult:
    """P producers committing one refund per transaction, as fast as they can, for ``seconds``
    while the worker runs."""
    clear_broker(svc)
    if system.has_receipts:
        prepare(svc, system)
    done = Done(svc, system)
    feeds = Feeds(svc, system, producers, seconds=seconds, warm=warm)
    proc = start_worker(svc, system, "live")
    try:
        warm_ids = feeds.ready()
        wait_ready(svc, system, proc)
        poll(lambda: warmed(proc, done, len(warm_ids)), 120, "the warm-up refunds", 0.02)
        t0 = time.time() + 0.3
        feeds.go(t0)
        time.sleep(max(0.0, t0 - time.time()))
        # Published by then, for the no-op: nothing but the warm-up.
        base, began = done.count(len(warm_ids)), time.time()
        time.sleep(max(0.0, t0 + seconds - time.time()))
        if system.name == "noop":
            # What was published by the end, from the producers' commit times.
            assert done.broker is not None
            pending_at_end, ended = done.broker.pending(), time.time()
            fed = feeds.join()
            published = len(warm_ids) + sum(1 for t in fed.committed.values() if t <= ended)
            finished = published - pending_at_end
        else:
            finished, ended = done.count(), time.time()
            fed = feeds.join()
        rate = (finished - base) / (ended - began)
        total = len(warm_ids) + len(fed.ids)
        poll(lambda: done.count(total) >= total, 300, "every refund of the live phase", 0.05)
    finally:
        svc.stop(proc)
        feeds.close()
        done.close()
    latency: list[float] = []
    verdict = None
    if system.has_receipts:
        window = [i for i in fed.ids if fed.committed[i] <= t0 + seconds]
        seen = receipt_times(svc.db_url, system, window)
        latency = [(seen[i] - fed.committed[i]) * 1000 for i in window if i in seen]
        verdict = judge(svc, system, warm_ids + fed.ids)
    return LiveResult(system, rate, len(fed.ids) / seconds, latency, verdict, ended - began)


@dataclass
class OpenResult:
    system: System
    rate: float  # offered
    reached: float  # the rate the producers reached
    latency_ms: list[float]
    late_ms: list[float]
    worker_cpu_ms: float  # per refund
    producer_cpu_ms: float  # per refund
    writes_per_refund: float  # the worker's write transactions
    commit_delta: int
    bench_commits: int
    handled: int  # refunds the worker handled over the phase, warm-ups included
    judgement: Judgement

    @property
    def p50(self) -> float:
        return statistics.median(self.latency_ms)

    @property
    def p99(self) -> float:
        return pct(self.latency_ms, 0.99)


def measure_open(
    svc: Services, system: System, *, rate: float, count: int, producers: int, warm: int
) -> OpenResult:
    """Refund k committed at ``t0 + k / rate`` by producer k mod P, while the worker runs."""
    clear_broker(svc)
    prepare(svc, system)
    baseline = settled_commits(svc.admin_url, svc.db_name)
    done = Done(svc, system)
    feeds = Feeds(svc, system, producers, rate=rate, count=count, warm=warm)
    proc = start_worker(svc, system, f"open{rate:g}")
    try:
        warm_ids = feeds.ready()
        wait_ready(svc, system, proc)
        poll(lambda: warmed(proc, done, len(warm_ids)), 120, "the warm-up refunds", 0.02)
        t0 = time.time() + 0.3
        feeds.go(t0)
        time.sleep(max(0.0, t0 - time.time()))
        cpu0 = tree_cpu(proc.pid)
        fed = feeds.join()
        total = len(warm_ids) + len(fed.ids)
        poll(lambda: done.count() >= total, 300, "every refund of the open loop", 0.02)
        cpu = tree_cpu(proc.pid) - cpu0
    finally:
        svc.stop(proc)
        feeds.close()
        done.close()
    delta = settled_commits(svc.admin_url, svc.db_name) - baseline
    bench = fed.commits + done.commits
    seen = receipt_times(svc.db_url, system, fed.ids)
    handled = len(warm_ids) + len(fed.ids)
    span = fed.last - t0
    return OpenResult(
        system=system, rate=rate, reached=len(fed.ids) / span if span > 0 else 0.0,
        latency_ms=[(seen[i] - fed.committed[i]) * 1000 for i in fed.ids],
        late_ms=fed.late_ms, worker_cpu_ms=cpu * 1000 / len(fed.ids),
        producer_cpu_ms=fed.cpu * 1000 / len(fed.ids),
        writes_per_refund=(delta - bench) / handled, commit_delta=delta, bench_commits=bench,
        handled=handled, judgement=judge(svc, system, warm_ids + fed.ids),
    )  # fmt: skip
