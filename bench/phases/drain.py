"""End-to-end maximum rate (a drain, as the no-op reference is measured) and the worker-side
commits per operation over it."""

from __future__ import annotations

import time
from dataclasses import dataclass

from bench.phases.common import (
    Broker,
    Services,
    pause,
    poll,
    resume,
    settled_commits,
    start_settled_worker,
    wait_worker,
)
from bench.phases.intake import Counter, Producer, ProducerProcesses


@dataclass
class DrainResult:
    ops_per_second: float  # resuming the consumer → last ``succeeded`` commit and last hint
    intake_per_second: float  # how fast the backlog was committed (paused consumer)
    drained_ops: int  # operations the worker handled in the counted phase (warm-ups included)
    commit_delta: int  # ``xact_commit`` over the phase
    bench_commits: int  # of which the benchmark's own (intake transactions, completion polls)

    @property
    def worker_commits(self) -> int:
        return self.commit_delta - self.bench_commits

    @property
    def commits_per_op(self) -> float:
        return self.worker_commits / self.drained_ops


def measure_drain(
    svc: Services, name: str, n: int, warmup: int, *, per_txn: int, producers: int = 0
) -> DrainResult:
    """Queue ``n`` operations while a fresh worker's consumer is paused, then time the drain.

    The intake is ``per_txn`` operations per transaction from this process, or, with
    ``producers``, one per transaction from that many processes committing concurrently (each
    with its own engine and Celery app, as a web app's processes). The relay publishes one hint
    message per transaction, or per 20 operations of one (``outbox.relay.PER_MESSAGE``).

    The drain runs from resuming the consumer to the last ``succeeded`` commit and the last
    hint consumed: hints for operations a batch already took are still queued, their (empty)
    claims are part of the cost. The worker runs with beat, as in production, so the sweeper
    re-hints any operation retried after a not-sent outcome.

    Worker-side commits: ``xact_commit`` of the database in ``pg_stat_database``, read before
    the phase and after every backend of the database has exited (exiting backends flush their
    counters; the worker is stopped before), minus the commits the benchmark itself made
    (intake transactions and completion polls, counted exactly). No LISTEN runs here: its
    backend would commit.
    """
    baseline = settled_commits(svc.admin_url, svc.db_name)
    producer = Producer(svc.endpoints)
    counter = Counter(svc.db_url)
    procs = ProducerProcesses(svc.endpoints, producers, n) if producers else None
    broker = Broker(svc.broker_url)
    proc = start_settled_worker(svc, name)
    process_commits = 0
    try:
        base = counter.succeeded()
        warm = producer.intake(warmup, 1)
        if procs is not None:
            warm += procs.start()
        wait_worker(producer.app, proc)
        counter.wait(base + len(warm), 60)
        pause(producer.app)
        if procs is not None:
            procs.go()
            intake = procs.join()
            process_commits = intake.commits
            intake_rate = n / intake.seconds
        else:
            began = time.monotonic()
            producer.intake(n, per_txn)
            intake_rate = n / (time.monotonic() - began)
        started = time.time()
        resume(producer.app)
        done = counter.wait(base + len(warm) + n, 600)
        poll(lambda: broker.pending() == 0, 600, "the remaining hints", 0.002)
        rate = n / (max(done, time.time()) - started)
    finally:
        svc.stop(proc)
        broker.close()
        if procs is not None:
            procs.close()
        producer.close()
        counter.close()
    delta = settled_commits(svc.admin_url, svc.db_name) - baseline
    return DrainResult(
        ops_per_second=rate,
        intake_per_second=intake_rate,
        drained_ops=len(warm) + n,
        commit_delta=delta,
        bench_commits=producer.commits + counter.commits + process_commits,
    )
