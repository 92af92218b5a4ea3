"""The whole pipeline on this machine: intake → Celery workers → simulator → receipt.

How to run, from the repository root (PostgreSQL and Redis must answer; nothing else is
needed)::

    python bench/pipeline.py                        # the full run (the large scan included)
    python bench/pipeline.py --quick                # development: 2-3 minutes
    python bench/pipeline.py --peers procrastinate,dbos   # with the external peers too
    python bench/pipeline.py --broker-faults        # only the app's commits while Redis is down

``--peers`` installs Procrastinate and DBOS (pinned) into a virtual environment of their own
under ``.bench-peers/`` (git-ignored) with ``python -m venv`` and pip, once; the product never
imports them. The figures are the machine's: run on a quiet one, twice.

One run creates a throwaway PostgreSQL database (dropped at the end), flushes a dedicated Redis
db index, starts the simulator (``settled simulator``, in-memory ledger) and measures, on the same
services (each phase in ``bench/phases/``):

* the simulator alone (C processes submitting refunds over HTTP), so that it is seen not to be
  the bottleneck;
* live traffic, the headline (``phases/live.py``): P producer processes (``--producers``) each
  committing one refund per transaction, as fast as they can for ``--live-seconds``, while the
  worker runs: Settled (``Outbox.enqueue``, hints published after commit by the relay), stock
  Celery no-op tasks published one per "commit" (``bench/noop_app.py``), plain Celery "safe"
  (``bench/peers/celery_safe.py``: the refund row committed, then an acks_late task that POSTs
  it with its stable key and writes a receipt row), and the ``--peers``; the rate is the
  refunds that reached their receipt in the window the producers were live, over its length;
  commit-to-receipt p50/p99 of the refunds committed in it;
* open loop at each of ``--open-rates`` (refund k committed at k / rate, ``rate ×
  --open-seconds`` refunds) for Settled and the peers: commit-to-receipt p50/p99, CPU per
  refund of the worker's process tree and, apart, of the producers, and the worker's write
  transactions per refund (``xact_commit``, as for the drains below; it counts read-only
  commits too, such as a poll or a LISTEN backend taking in a notification). Receipt times are
  stamped in the statement that writes the receipt, not seen through NOTIFY. Every system of
  these two phases is judged after each: one effect in the simulator's ledger per idempotency
  key and one receipt per refund; a figure of a system not judged correct counts for no target;
* two no-op drains, the references: ``bench.noop`` tasks through stock Celery (kombu's own
  Redis transport, none of the product's broker tweaks) and through the product's Celery
  configuration, both with acks_late, prefetch 1, JSON and the same worker flags, pool and
  concurrency (``bench/noop_app.py``); tasks are queued while the worker's consumer is
  paused, then the clock runs from resuming it until none is queued or unacknowledged. On
  each no-op worker, idle, Celery's own publish-to-start latency: one ``bench.started`` task
  at a time, from just before the publish to the start of its body;
* the drained backlog: end-to-end operations per second, the same way (``phases/drain.py``):
  operations are queued while a fresh worker's consumers are paused, then the clock runs from
  resuming them to the last ``succeeded`` commit and the last hint consumed, so the rate
  compares with the no-op drains. The worker runs with beat, as in production, so the sweeper
  re-hints any operation retried after a not-sent outcome. Twice: the single-commit path, one
  operation per intake transaction committed by P producer processes at once (``--producers``;
  each with its own engine and Celery app, one hint message per operation), the path of a web
  app; and the batched path, 100 operations per intake transaction from one process (one hint
  message per 20 operations, the relay's default);
* worker-side commits per operation over each drain: ``xact_commit`` of the database in
  ``pg_stat_database``, read before the worker starts and after every backend of the
  database has exited (exiting backends flush their counters), minus the commits the
  benchmark itself made (intake transactions and completion polls, counted exactly);
* commit-to-receipt latency (``phases/latency.py``), on a fresh worker, seen through a NOTIFY
  trigger by a listener process of its own: one operation alone on the idle system, many
  times; then p50/p99 with P producer processes committing one operation per transaction,
  open loop at half the single-commit maximum rate (operation k arrives at k / rate); then,
  as a reference, the earlier measure: one producer at half the batched maximum rate whose
  transactions commit every operation that has arrived;
* a raw-SQL lifecycle with psycopg (insert, fenced claim, fenced outcome: three commits) from C
  threads, in the same database after the counters were read;
* scan flatness (``phases/scan.py``): the sweeper's and the reconciler's pass over a table of
  10^4 and of 10^6 operations (filled on the server, mostly terminal, the same live operations
  in both), in a throwaway database of its own.

``--broker-faults`` runs one phase alone instead (``phases/broker_faults.py``, about two minutes):
the app's commit latency, one producer committing one refund per transaction at ``--fault-rate``
per second while a worker with beat runs, for ``--fault-seconds`` each with Redis answering,
frozen (SIGSTOP), answering again, and refusing connections (killed, then started again empty),
on a Redis server of its own on a free port; then every refund judged (one effect at the
simulator, one receipt), and the app's breaker's log lines shown. The target of issue 45 is
printed beside: each outage's p50 and p99 within 50 ms of normal's.

It prints a table with the targets of issues 17 and 31 beside the figures (and whether each is
met; the ratios are to the peers measured in the same run), and asserts nothing. ``--quick``
sets small counts and short windows (``QUICK``; an option given too wins); ``--scan-large 0``
leaves the scan phase out.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # ``python bench/pipeline.py`` from anywhere
    sys.path.insert(0, str(ROOT))

from bench.peers.external import EXTERNAL_PEERS, prepare_peers  # noqa: E402
from bench.phases.broker_faults import (  # noqa: E402
    OUTAGES,
    BrokerFaultsResult,
    measure_broker_faults,
)
from bench.phases.common import (  # noqa: E402
    API_KEY,
    ORDER,
    TENANT,
    Endpoints,
    Services,
    autovacuum_runs,
    free_port,
    libpq,
    pct,
    poll,
    throwaway_database,
)
from bench.phases.drain import DrainResult, measure_drain  # noqa: E402
from bench.phases.latency import LatencyResult, measure_latency  # noqa: E402
from bench.phases.live import (  # noqa: E402
    CELERY_SAFE,
    NOOP,
    SETTLED,
    LiveResult,
    OpenResult,
    System,
    drop_stamp,
    measure_live,
    measure_open,
)
from bench.phases.noop import NoopResult, measure_noop  # noqa: E402
from bench.phases.reference import measure_raw_sql, measure_simulator  # noqa: E402
from bench.phases.scan import ScanResult, measure_scans  # noqa: E402
from outbox.db import make_engine, upgrade  # noqa: E402
from outbox.logs import TextFormatter  # noqa: E402
from outbox.models import Operation  # noqa: E402
from outbox.settings import Settings  # noqa: E402
from tests.support.stack import RedisProcess  # noqa: E402


@dataclass
class Results:
    sim_rate: float
    noop_product: NoopResult
    noop_stock: NoopResult
    batched: DrainResult
    single: DrainResult
    latency: LatencyResult
    done: int  # operations succeeded with a receipt
    total: int
    raw_rate: float
    vacuums: int  # autovacuum/autoanalyze runs during the batched drain
    scan: ScanResult | None
    live: dict[str, LiveResult] = field(default_factory=dict)  # by system name
    opened: dict[float, dict[str, OpenResult]] = field(default_factory=dict)  # rate → system


def verify(db_url: str) -> tuple[int, int]:
    """Operations succeeded with a receipt, and all operations (run after the counters)."""
    engine = make_engine(db_url)
    try:
        with Session(engine) as s:
            done = s.scalar(
                select(func.count()).where(
                    Operation.state == "succeeded", Operation.receipt.is_not(None)
                )
            )
            total = s.scalar(select(func.count()).select_from(Operation))
            retried = s.scalar(select(func.count()).where(Operation.attempts > 1))
    finally:
        engine.dispose()
    if retried:
        print(f"  note: {retried} operations needed more than one attempt (not sent: retried)")
    return int(done or 0), int(total or 0)


def start_simulator(svc: Services, port: int) -> None:
    svc.spawn(
        "simulator",
        [sys.executable, "-m", "settled.cli", "simulator", "--port", str(port),
         "--ledger", ":memory:", "--test-mode", "--tenant", f"{TENANT}={API_KEY}"],
    )  # fmt: skip
    from settled.simulator import SimulatorControl

    def sim_up() -> bool:
        try:
            with SimulatorControl(svc.sim_url) as control:
                control.create_order(TENANT, ORDER, 10**15)
            return True
        except Exception:
            return False

    poll(sim_up, 30, "the simulator", 0.1)


def run_pipeline(args: argparse.Namespace, svc: Services) -> Results:
    """Every phase on the pipeline's services, one after another."""
    step = "  measuring"
    print(f"{step} the simulator alone ...", flush=True)
    sim_rate = measure_simulator(svc.sim_url, args.concurrency, args.sim_requests)
    noop_tasks = args.noop_tasks or 2 * args.ops
    print(f"{step} the no-op drain, the product's Celery configuration ...", flush=True)
    noop_product = measure_noop(svc, noop_tasks, stock=False, idle=args.idle_ops)
    print(f"{step} the no-op drain, stock Celery ...", flush=True)
    noop_stock = measure_noop(svc, noop_tasks, stock=True, idle=args.idle_ops)
    print(f"{step} the drained backlog, 100 operations per intake commit ...", flush=True)
    vacuums = autovacuum_runs(svc.db_url)
    batched = measure_drain(svc, "settled-worker-batched", args.ops, args.warmup, per_txn=100)
    vacuums = autovacuum_runs(svc.db_url) - vacuums
    print(f"{step} the drained backlog, one operation per intake commit, {args.producers} "
          "producer processes ...", flush=True)  # fmt: skip
    single = measure_drain(
        svc, "settled-worker-single", args.single_ops, args.warmup,
        per_txn=1, producers=args.producers,
    )  # fmt: skip
    live, opened = measure_live_and_open(args, svc)
    rate = args.latency_rate or single.ops_per_second / 2
    print(f"{step} commit-to-receipt latency: idle, then at {rate:.0f} ops/s ...", flush=True)
    latency = measure_latency(
        svc, ops=args.latency_ops, rate=rate, batched_rate=batched.ops_per_second / 2,
        producers=args.producers, idle=args.idle_ops, warmup=args.warmup,
    )  # fmt: skip
    done, total = verify(svc.db_url)
    print(f"{step} the raw-SQL lifecycle ...", flush=True)
    raw_rate = measure_raw_sql(svc.db_url, args.concurrency, args.raw_ops)
    return Results(
        sim_rate, noop_product, noop_stock, batched, single, latency, done, total, raw_rate,
        vacuums, scan=None, live=live, opened=opened,
    )  # fmt: skip


def measure_live_and_open(
    args: argparse.Namespace, svc: Services
) -> tuple[dict[str, LiveResult], dict[float, dict[str, OpenResult]]]:
    """The live-traffic phase for Settled, the stock Celery no-op and every peer; then the
    open-loop phase at each offered rate for Settled and every peer (``phases/live.py``)."""
    step = "  measuring"
    peers: list[System] = [CELERY_SAFE, *args.external]
    live: dict[str, LiveResult] = {}
    for system in (SETTLED, NOOP, *peers):
        print(f"{step} live traffic, {system.label}: {args.producers} producer processes, one "
              f"refund per commit, {args.live_seconds:g} s ...", flush=True)  # fmt: skip
        live[system.name] = measure_live(
            svc, system, producers=args.producers, seconds=args.live_seconds,
            warm=args.warmup,
        )  # fmt: skip
    opened: dict[float, dict[str, OpenResult]] = {}
    for rate in args.open_rates:
        count = max(1, round(rate * args.open_seconds))
        for system in (SETTLED, *peers):
            print(f"{step} open loop at {rate:g}/s, {system.label}: {count} refunds ...",
                  flush=True)  # fmt: skip
            opened.setdefault(rate, {})[system.name] = measure_open(
                svc, system, rate=rate, count=count, producers=args.producers, warm=args.warmup
            )
    drop_stamp(svc.db_url)
    return live, opened


# -- the table -------------------------------------------------------------------------------


def _met(ok: bool) -> str:
    return "yes" if ok else "NO"


def table(r: Results, producers: int) -> list[tuple[str, str, str, str]]:
    """(figure, measured, target, met) rows; a row with only a figure heads a section."""
    stock = r.noop_stock.drain_per_second
    product = r.noop_product.drain_per_second
    single, batched, lat = r.single, r.batched, r.latency
    s_ratio = single.ops_per_second / stock
    b_ratio = batched.ops_per_second / stock
    p50 = statistics.median(lat.loaded_ms)
    p99 = pct(lat.loaded_ms, 0.99)
    idle50 = statistics.median(lat.idle_ms)
    celery50 = statistics.median(r.noop_stock.start_ms)
    at = f"{lat.loaded_rate:.0f} ops/s"
    rows = live_rows(r, producers) + open_rows(r)
    rows += [
        ("drained backlog (queued while the consumers were paused, then timed)", "", "", ""),
        (f"drained backlog, one op per intake commit, {producers} producer processes, ops/s",
         f"{single.ops_per_second:.0f}",
         f">= {0.6 * stock:.0f} (0.6 × stock no-op; stretch {0.8 * stock:.0f})",
         _met(s_ratio >= 0.6)),
        ("  ÷ stock Celery no-op drain", f"{s_ratio:.2f}", ">= 0.60 (stretch 0.80)",
         _met(s_ratio >= 0.6)),
        ("  ÷ product-config no-op drain", f"{single.ops_per_second / product:.2f}",
         "reference", ""),
        ("drained backlog, 100 ops per intake commit (batched), ops/s",
         f"{batched.ops_per_second:.0f}",
         f">= {0.8 * stock:.0f} (0.8 × stock no-op)", _met(b_ratio >= 0.8)),
        ("  ÷ stock Celery no-op drain", f"{b_ratio:.2f}", ">= 0.80", _met(b_ratio >= 0.8)),
        ("  ÷ product-config no-op drain", f"{batched.ops_per_second / product:.2f}",
         "reference (issue 4: >= 0.60)", ""),
        ("no-op drain, stock Celery (kombu's Redis transport), tasks/s", f"{stock:.0f}",
         "reference", ""),
        ("no-op drain, the product's Celery configuration, tasks/s", f"{product:.0f}",
         "reference", ""),
        ("latency (intake commit → receipt commit)", "", "", ""),
        (f"p50 at {at} (half the single-commit max, one per commit)", f"{p50:.1f} ms",
         "<= 20 ms", _met(p50 <= 20)),
        (f"p99 at {at}", f"{p99:.1f} ms", "<= 100 ms", _met(p99 <= 100)),
        ("  producers' delay behind the open loop, p99", f"{pct(lat.late_ms, 0.99):.1f} ms",
         "reference", ""),
        ("one op alone on an idle system, p50", f"{idle50:.1f} ms",
         f"<= {2 * celery50:.1f} ms (2 × Celery's publish-to-start)",
         _met(idle50 <= 2 * celery50)),
        ("  p99", f"{pct(lat.idle_ms, 0.99):.1f} ms", "reference", ""),
        ("Celery publish-to-start, no-op, idle worker: stock, p50", f"{celery50:.1f} ms",
         "reference", ""),
        ("  the same, product's Celery configuration, p50",
         f"{statistics.median(r.noop_product.start_ms):.1f} ms", "reference", ""),
    ]  # fmt: skip
    if lat.batched_ms:
        at_b = f"{lat.batched_rate:.0f} ops/s"
        rows += [
            (f"p50 at {at_b} (half the batched max, commits what arrived)",
             f"{statistics.median(lat.batched_ms):.1f} ms", "reference", ""),
            (f"p99 at {at_b}", f"{pct(lat.batched_ms, 0.99):.1f} ms", "reference", ""),
            ("  operations per intake commit then", f"{lat.batched_per_commit:.2f}",
             "reference", ""),
        ]  # fmt: skip
    rows += [
        ("worker-side PostgreSQL commits per operation (drained backlog)", "", "", ""),
        ("one op per intake commit", f"{single.commits_per_op:.2f}", "<= 2.2",
         _met(single.commits_per_op <= 2.2)),
        ("100 ops per intake commit", f"{batched.commits_per_op:.2f}", "reference", ""),
    ]  # fmt: skip
    if r.scan is not None:
        small, large = (f"{n:,}" for n in r.scan.sizes)
        rows += [("scans (the same pass at two table sizes, median)", "", "", "")]
        for name, (ms_small, ms_large), ratio in (
            ("sweeper", r.scan.sweep_ms, r.scan.sweep_ratio),
            ("reconciler", r.scan.reconcile_ms, r.scan.reconcile_ratio),
        ):
            rows += [
                (f"{name} pass, {small} operations", f"{ms_small:.2f} ms", "reference", ""),
                (f"{name} pass, {large} operations", f"{ms_large:.2f} ms",
                 f"<= {2 * ms_small:.2f} ms", _met(ratio <= 2)),
                ("  large ÷ small", f"{ratio:.2f}", "<= 2", _met(ratio <= 2)),
            ]  # fmt: skip
    rows += [
        ("references", "", "", ""),
        ("simulator alone, requests/s", f"{r.sim_rate:.0f}", "reference", ""),
        ("raw-SQL lifecycle (3 commits), ops/s", f"{r.raw_rate:.0f}", "reference", ""),
        ("intake, 100 per transaction, one process, ops/s", f"{batched.intake_per_second:.0f}",
         "reference", ""),
        (f"intake, one per transaction, {producers} processes, ops/s",
         f"{single.intake_per_second:.0f}", "reference", ""),
    ]  # fmt: skip
    return rows


def _judged(result: LiveResult | OpenResult) -> bool:
    return result.judgement is not None and result.judgement.correct


def live_rows(r: Results, producers: int) -> list[tuple[str, str, str, str]]:
    """The headline: one refund per commit from P producer processes while the workers run."""
    if not r.live:
        return []
    settled, noop = r.live["settled"], r.live["noop"]
    peers = [v for k, v in r.live.items() if k not in ("settled", "noop")]
    ok = _judged(settled)
    ratio = settled.rate / noop.rate if noop.rate else float("nan")
    rows = [
        (f"live traffic: one refund per commit, {producers} producer processes, workers "
         "running", "", "", ""),
        ("Settled, refunds/s reaching succeeded", f"{settled.rate:.0f}",
         f">= {0.6 * noop.rate:.0f} (0.6 × stock Celery no-op, live)" if ok
         else "(no figure: Settled not judged correct)", _met(ratio >= 0.6) if ok else ""),
        ("  ÷ stock Celery no-op, live", f"{ratio:.2f}", ">= 0.60", _met(ratio >= 0.6) if ok
         else ""),
    ]  # fmt: skip
    for peer in peers:
        ratio = settled.rate / peer.rate if peer.rate else float("nan")
        want = 1.2 if peer.system is CELERY_SAFE else None
        if not (ok and _judged(peer)):
            rows.append((f"  ÷ {peer.system.label}, live", f"{ratio:.2f}",
                         "(no figure: not judged correct)", ""))  # fmt: skip
        elif want is None:
            rows.append((f"  ÷ {peer.system.label}, live", f"{ratio:.2f}", "reference", ""))
        else:
            rows.append((f"  ÷ {peer.system.label}, live", f"{ratio:.2f}", f">= {want:.2f}",
                         _met(ratio >= want)))  # fmt: skip
    rows.append(("stock Celery no-op, live, tasks/s", f"{noop.rate:.0f}", "reference", ""))
    for peer in peers:
        rows.append((f"{peer.system.label}, live, refunds/s", f"{peer.rate:.0f}",
                     "reference" if _judged(peer) else "(not judged correct)", ""))  # fmt: skip
    for result in (settled, *peers):
        rows += [
            (f"{result.system.label}, live, commit → receipt p50", f"{result.p50:.1f} ms",
             "reference", ""),
            ("  p99", f"{result.p99:.1f} ms", "reference", ""),
        ]  # fmt: skip
    return rows


def target_rate(rates: list[float]) -> float:
    """The offered rate the issue's targets are for: 100/s, or the nearest measured."""
    return min(rates, key=lambda rate: abs(rate - 100))


def open_rows(r: Results) -> list[tuple[str, str, str, str]]:
    """Open loop at fixed offered rates: latency, CPU and write transactions per refund."""
    if not r.opened:
        return []
    rows: list[tuple[str, str, str, str]] = []
    at_target = target_rate(list(r.opened))
    for rate, results in r.opened.items():
        settled, safe = results["settled"], results["celery_safe"]
        targets = rate == at_target and _judged(settled) and _judged(safe)
        rows.append((f"open loop at {rate:g}/s offered (refund k committed at k / rate)",
                     "", "", ""))  # fmt: skip
        if targets:
            rows += [
                ("Settled commit → receipt p50", f"{settled.p50:.1f} ms",
                 f"<= {1.5 * safe.p50:.1f} ms (1.5 × plain Celery safe)",
                 _met(settled.p50 <= 1.5 * safe.p50)),
                ("Settled commit → receipt p99", f"{settled.p99:.1f} ms", "<= 50 ms",
                 _met(settled.p99 <= 50)),
                ("Settled worker CPU per refund", f"{settled.worker_cpu_ms:.2f} ms",
                 f"<= {1.2 * safe.worker_cpu_ms:.2f} ms (1.2 × plain Celery safe)",
                 _met(settled.worker_cpu_ms <= 1.2 * safe.worker_cpu_ms)),
                ("Settled worker write transactions per refund",
                 f"{settled.writes_per_refund:.2f}", "<= 2.0",
                 _met(settled.writes_per_refund <= 2.0)),
            ]  # fmt: skip
        else:
            note = "reference" if _judged(settled) else "(not judged correct)"
            rows += [
                ("Settled commit → receipt p50", f"{settled.p50:.1f} ms", note, ""),
                ("Settled commit → receipt p99", f"{settled.p99:.1f} ms", note, ""),
                ("Settled worker CPU per refund", f"{settled.worker_cpu_ms:.2f} ms", note, ""),
                ("Settled worker write transactions per refund",
                 f"{settled.writes_per_refund:.2f}", note, ""),
            ]  # fmt: skip
        rows.append(("  Settled producers' CPU per refund (app side)",
                     f"{settled.producer_cpu_ms:.2f} ms", "reference", ""))  # fmt: skip
        for name, peer in results.items():
            if name == "settled":
                continue
            note = "reference" if _judged(peer) else "(not judged correct)"
            label = peer.system.label
            rows += [
                (f"{label} commit → receipt p50", f"{peer.p50:.1f} ms", note, ""),
                (f"{label} commit → receipt p99", f"{peer.p99:.1f} ms", note, ""),
                (f"{label} worker CPU per refund", f"{peer.worker_cpu_ms:.2f} ms", note, ""),
                (f"{label} worker write transactions per refund",
                 f"{peer.writes_per_refund:.2f}", note, ""),
                (f"  {label} producers' CPU per refund (app side)",
                 f"{peer.producer_cpu_ms:.2f} ms", note, ""),
            ]  # fmt: skip
    return rows


def print_table(rows: list[tuple[str, str, str, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    value = max(10, *(len(r[1]) for r in rows))
    target = max(len(r[2]) for r in rows)
    print()
    print(f"{'figure':<{width}}  {'measured':>{value}}  {'target':<{target}}  met")
    print(f"{'-' * width}  {'-' * value}  {'-' * target}  ---")
    for name, measured, goal, met in rows:
        if not measured:
            print(f"{name}")
            continue
        print(f"{name:<{width}}  {measured:>{value}}  {goal:<{target}}  {met}".rstrip())


def print_notes(r: Results, args: argparse.Namespace) -> None:
    print()
    print(
        "throughput: operations (no-op tasks) queued while the worker's consumers were paused, "
        "timed from resuming them to the last receipt and the last message acknowledged"
    )
    print(f"operations: {r.done} of {r.total} succeeded with a receipt.")
    for live in r.live.values():
        judged = f"; judged: {live.judgement}" if live.judgement is not None else ""
        print(f"live, {live.system.label}: {live.rate * live.window:.0f} reached their receipt "
              f"in the {live.window:.1f} s window, committed {live.committed_rate:.0f}/s; "
              f"{len(live.latency_ms)} latency samples{judged}")  # fmt: skip
    for rate, results in r.opened.items():
        for o in results.values():
            print(f"open loop {rate:g}/s, {o.system.label}: reached {o.reached:.0f}/s, "
                  f"producers late p99 {pct(o.late_ms, 0.99):.1f} ms; xact_commit delta "
                  f"{o.commit_delta}, of which the benchmark's own {o.bench_commits}, over "
                  f"{o.handled} refunds; judged: {o.judgement}")  # fmt: skip
    if r.live or r.opened:
        print(
            "judged: every refund's idempotency key has one effect in the simulator's "
            "ledger, and one receipt (Settled: succeeded with a receipt); a figure of a "
            "system not judged correct is shown but counts for no target"
        )
    for name, d in (("batched", r.batched), ("single-commit", r.single)):
        print(
            f"commits over the {name} drain ({d.drained_ops} operations, warm-ups included): "
            f"xact_commit delta {d.commit_delta}, of which the benchmark's own "
            f"{d.bench_commits} (intake transactions, completion polls)"
        )
    print(f"autovacuum/autoanalyze runs during the batched drain: {r.vacuums}")
    print(f"no-op transports: stock {r.noop_stock.transport}; product {r.noop_product.transport}")
    print(
        f"latency samples: {len(r.latency.idle_ms)} alone, {len(r.latency.loaded_ms)} loaded, "
        f"{len(r.latency.batched_ms)} batched; publish-to-start samples: "
        f"{len(r.noop_stock.start_ms)} stock, {len(r.noop_product.start_ms)} product"
    )
    if r.scan is not None:
        print(
            f"scan table: {r.scan.hinted} operations due (re-hinted by every sweep), "
            f"{args.scan_live} live and not due, the rest terminal; filling and vacuuming the "
            f"large table took {r.scan.fill_seconds:.1f} s; {args.scan_repeats} passes each"
        )


# -- main ------------------------------------------------------------------------------------


#: ``--quick``: what it sets (an option given on the command line wins).
QUICK: dict[str, object] = {
    "ops": 200, "single_ops": 200, "latency_ops": 100, "idle_ops": 20, "scan_large": 20000,
    "live_seconds": 4.0, "open_seconds": 3.0, "warmup": 20,
}  # fmt: skip


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of rates: {text!r}") from None
    if not rates or any(rate <= 0 for rate in rates):
        raise argparse.ArgumentTypeError("rates must be positive numbers, comma-separated")
    return rates


def _peer_names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in EXTERNAL_PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown peer {', '.join(unknown)}; known: {', '.join(EXTERNAL_PEERS)}"
        )
    return names


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=3000, help="operations in the batched drain")
    parser.add_argument(
        "--single-ops", type=int, default=2000, help="operations in the single-commit drain"
    )
    parser.add_argument(
        "--producers", type=int, default=4, help="producer processes of the single-commit path"
    )
    parser.add_argument(
        "--latency-ops", type=int, default=1000, help="operations of each loaded latency phase"
    )
    parser.add_argument(
        "--latency-rate", type=float, default=None, help="default: half the single-commit max"
    )
    parser.add_argument(
        "--idle-ops", type=int, default=100,
        help="operations alone on the idle system, and Celery tasks published one at a time",
    )  # fmt: skip
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--noop-tasks", type=int, default=None, help="default: 2 × --ops")
    parser.add_argument("--raw-ops", type=int, default=3000)
    parser.add_argument("--sim-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=4, help="worker pool size")
    parser.add_argument(
        "--pool", default="prefork", choices=["prefork", "threads", "solo"],
        help="worker pool, the same for the no-op and the settled workers",
    )  # fmt: skip
    parser.add_argument(
        "--claim-batch", type=int, default=None, help="SETTLED_CLAIM_BATCH (default: settings)"
    )
    parser.add_argument(
        "--doorbell", type=int, default=None,
        help="SETTLED_HINT_DOORBELL, producers and workers (default: settings)",
    )  # fmt: skip
    parser.add_argument("--scan-small", type=int, default=10_000, help="operations, small table")
    parser.add_argument(
        "--scan-large", type=int, default=1_000_000, help="operations, large table (0: no scans)"
    )
    parser.add_argument("--scan-live", type=int, default=1000, help="live operations, not due")
    parser.add_argument("--scan-due", type=int, default=100, help="planned operations due")
    parser.add_argument("--scan-repeats", type=int, default=20, help="timed passes per size")
    parser.add_argument(
        "--live-seconds", type=float, default=20.0,
        help="the live-traffic window: how long the producers commit, per system",
    )  # fmt: skip
    parser.add_argument(
        "--open-rates", type=_rates, default=[50.0, 100.0],
        help="offered rates of the open-loop phase, refunds/s, comma-separated",
    )  # fmt: skip
    parser.add_argument(
        "--open-seconds", type=float, default=20.0, help="refunds offered: rate × this, per rate"
    )
    parser.add_argument(
        "--peers", type=_peer_names, default=[],
        help="more peers, installed by the bench into .bench-peers/ (comma-separated: "
        "procrastinate,dbos)",
    )  # fmt: skip
    parser.add_argument(
        "--broker-faults", action="store_true",
        help="only the app's commit latency with Redis answering, frozen and refusing "
        "connections (on a Redis of its own), then every refund judged",
    )  # fmt: skip
    parser.add_argument(
        "--fault-seconds", type=float, default=30.0, help="--broker-faults: each window"
    )
    parser.add_argument(
        "--fault-rate", type=float, default=50.0, help="--broker-faults: commits per second"
    )
    parser.add_argument(
        "--quick", action="store_true",
        help="a development run of 2-3 minutes: small counts, short windows, no large scan",
    )  # fmt: skip
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/14", help="flushed!")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument(
        "--log-statements", action="store_true", help="log every statement to the server log"
    )
    args = parser.parse_args(argv)
    if args.quick:
        given = set(argv if argv is not None else sys.argv[1:])
        for option, value in QUICK.items():
            if f"--{option.replace('_', '-')}" not in given:
                setattr(args, option, value)
    if args.live_seconds <= 0 or args.open_seconds <= 0:
        parser.error("--live-seconds and --open-seconds must be positive")
    if args.fault_seconds <= 0 or args.fault_rate <= 0:
        parser.error("--fault-seconds and --fault-rate must be positive")
    for name in ("ops", "single_ops", "producers", "latency_ops", "idle_ops", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.scan_large and args.scan_large < args.scan_small:
        parser.error("--scan-large must be at least --scan-small")
    if args.scan_small < args.scan_live + args.scan_due:
        parser.error("--scan-small must hold --scan-live and --scan-due operations")
    return args


def flush(url: str) -> None:
    with suppress(redis.RedisError):
        client = redis.Redis.from_url(url)
        client.flushdb()
        client.close()


def broker_fault_rows(r: BrokerFaultsResult, seconds: float) -> list[tuple[str, str, str, str]]:
    """The app's commit latency in each window, the target of issue 45 beside the outages'."""
    normal = r.latency_ms["normal"]
    n50, n99 = statistics.median(normal), pct(normal, 0.99)
    what = {"frozen": f"Redis frozen {seconds:g} s (SIGSTOP)",
            "refusing": f"Redis refusing connections {seconds:g} s (killed)"}  # fmt: skip
    rows = [
        ("app commit latency (one refund per intake transaction, its hint after commit "
         "included)", "", "", ""),
        (f"Redis answering, p50 ({len(normal)} commits)", f"{n50:.1f} ms", "reference", ""),
        ("  p99", f"{n99:.1f} ms", "reference", ""),
    ]  # fmt: skip
    back = r.latency_ms["back"]
    rows += [
        (f"Redis answering again, p50 ({len(back)} commits)", f"{statistics.median(back):.1f} ms",
         "reference", ""),
        ("  p99", f"{pct(back, 0.99):.1f} ms", "reference", ""),
    ]  # fmt: skip
    for window in OUTAGES:
        ms = r.latency_ms[window]
        p50, p99 = statistics.median(ms), pct(ms, 0.99)
        rows += [
            (f"{what[window]}, p50 ({len(ms)} commits)", f"{p50:.1f} ms",
             f"<= {n50 + 50:.1f} ms (normal + 50 ms)", _met(p50 <= n50 + 50)),
            ("  p99", f"{p99:.1f} ms", f"<= {n99 + 50:.1f} ms (normal + 50 ms)",
             _met(p99 <= n99 + 50)),
            ("  max", f"{max(ms):.1f} ms", "reference", ""),
            ("  producer behind its open loop, p99", f"{pct(r.late_ms[window], 0.99):.1f} ms",
             "reference", ""),
        ]  # fmt: skip
    j = r.judgement
    rows += [
        ("every refund of the four windows settled once Redis was back", "", "", ""),
        ("refunds with one effect and one receipt", f"{j.refunds - j.missing - j.duplicated}"
         f"/{j.refunds}", "all (0 lost, 0 duplicated)", _met(j.correct)),
        ("  last one succeeded after Redis was back", f"{r.settled_after:.1f} s", "reference",
         ""),
    ]  # fmt: skip
    return rows


def claim_batch_and_doorbell(args: argparse.Namespace) -> tuple[int, int]:
    """``--claim-batch`` and ``--doorbell``, else the settings' defaults."""
    defaults = Settings()
    return (
        defaults.claim_batch if args.claim_batch is None else args.claim_batch,
        defaults.hint_doorbell if args.doorbell is None else args.doorbell,
    )


def services(
    args: argparse.Namespace, db_name: str, db_url: str, broker: str, sim_port: int, workdir: Path
) -> Services:
    """The services of a run: its throwaway database, ``broker``, the simulator's port."""
    claim_batch, doorbell = claim_batch_and_doorbell(args)
    return Services(
        admin_url=args.pg,
        db_name=db_name,
        endpoints=Endpoints(db_url, broker, f"http://127.0.0.1:{sim_port}", doorbell, claim_batch),
        workdir=workdir,
        concurrency=args.concurrency,
        pool=args.pool,
        claim_batch=claim_batch,
    )


def print_log_tails(svc: Services) -> None:
    for name in svc.logs():
        tail = svc.log_tail(name)
        if tail:
            print(f"--- {name} log (tail)\n{tail}", file=sys.stderr)


def run_broker_faults(args: argparse.Namespace) -> int:
    """``--broker-faults``: that phase alone, on a Redis server of its own."""
    doorbell = claim_batch_and_doorbell(args)[1]
    workdir = Path(tempfile.mkdtemp(prefix="settled-bench-"))
    # The app's breaker's lines (one WARNING and one INFO per outage), as an operator sees them.
    lines = logging.StreamHandler(sys.stdout)
    lines.setFormatter(TextFormatter())
    logging.getLogger("outbox.breaker").addHandler(lines)
    logging.getLogger("outbox.breaker").setLevel(logging.INFO)
    own = RedisProcess()
    own.start()
    sim_port = free_port()
    try:
        with throwaway_database(args.pg, "faults") as (db_name, db_url):
            upgrade(db_url)
            svc = services(args, db_name, db_url, own.url, sim_port, workdir)
            print(f"{os.cpu_count()} cores; {args.pool} pool, concurrency {args.concurrency}; "
                  f"doorbell {doorbell}; the app's hints: {Settings().hint_timeout * 1000:g} ms "
                  f"per round trip, {Settings().hint_cooldown_seconds:g} s cool-down; Redis "
                  f"of its own at {own.url}")  # fmt: skip
            try:
                start_simulator(svc, sim_port)
                result = measure_broker_faults(
                    svc, own, rate=args.fault_rate, seconds=args.fault_seconds, warm=args.warmup
                )
            except BaseException:
                print_log_tails(svc)
                raise
            finally:
                svc.stop_all()
    finally:
        own.thaw()
        own.stop()
    print_table(broker_fault_rows(result, args.fault_seconds))
    print()
    hints = ", ".join(f"{n:.0f} {o}" for o, n in result.hints.items())
    print(f"the app's hints over the four windows (settled_hints_total): {hints}")
    print(f"judged: {result.judgement}")
    if args.keep_logs:
        print(f"logs: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.broker_faults:
        return run_broker_faults(args)
    # The peers' own environment, before any service starts (an install takes a while).
    args.external = prepare_peers(args.peers, ROOT / ".bench-peers")
    claim_batch, doorbell = claim_batch_and_doorbell(args)
    workdir = Path(tempfile.mkdtemp(prefix="settled-bench-"))
    flush(args.redis)
    sim_port = free_port()
    with throwaway_database(args.pg) as (db_name, db_url):
        upgrade(db_url)
        with psycopg.connect(libpq(db_url), autocommit=True) as conn:
            if args.log_statements:
                conn.execute(f"ALTER DATABASE \"{db_name}\" SET log_statement = 'all'")
            sync = conn.execute("SHOW synchronous_commit").fetchone()
        svc = services(args, db_name, db_url, args.redis, sim_port, workdir)
        print(f"PostgreSQL synchronous_commit={sync[0] if sync else '?'}; "
              f"{os.cpu_count()} cores; {args.pool} pool, concurrency {args.concurrency}; "
              f"claim_batch {claim_batch}; doorbell {doorbell}; "
              f"{args.producers} producer processes")  # fmt: skip
        try:
            start_simulator(svc, sim_port)
            results = run_pipeline(args, svc)
        except BaseException:
            print_log_tails(svc)
            raise
        finally:
            svc.stop_all()
    flush(args.redis)
    if args.scan_large:
        print(f"  measuring the scans at {args.scan_small:,} and {args.scan_large:,} "
              "operations ...", flush=True)  # fmt: skip
        results.scan = measure_scans(
            args.pg, small=args.scan_small, large=args.scan_large, live=args.scan_live,
            due=args.scan_due, repeats=args.scan_repeats,
        )  # fmt: skip

    print_table(table(results, args.producers))
    print_notes(results, args)
    if args.keep_logs:
        print(f"logs: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
