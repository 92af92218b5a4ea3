"""Commit-to-receipt latency: one operation alone on an idle system; P producer processes
committing one operation per transaction, open loop, at a given rate; and the earlier
reference, one producer committing whatever has arrived.

Measured from the intake's commit (taken before the relay publishes the hint) to the commit
that wrote the receipt, seen through a NOTIFY trigger the bench installs in its throwaway
database for these phases only (a notification is delivered at commit, so no polling), by a
listener process of its own (so it never shares a producer's GIL).
"""

from __future__ import annotations

import multiprocessing
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import psycopg

from bench.phases.common import Services, libpq, start_settled_worker, wait_worker
from bench.phases.intake import Producer, ProducerProcesses

CHANNEL = "settled_bench"

NOTIFY_TRIGGER = f"""
CREATE FUNCTION bench_notify_succeeded() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{CHANNEL}', NEW.id::text);
    RETURN NULL;
END $$;
CREATE TRIGGER bench_succeeded AFTER UPDATE OF state ON operations FOR EACH ROW
    WHEN (NEW.state = 'succeeded' AND OLD.state <> 'succeeded')
    EXECUTE FUNCTION bench_notify_succeeded();
"""


def _listen(db_url: str, requests: Any, ready: Any) -> None:
    """The listener process: notes when each ``succeeded`` commit became visible, and answers
    ``(ids, timeout)`` with the times of those ids it saw (``None`` ends it)."""
    seen: dict[int, float] = {}
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        ready.set()
        while True:
            for note in conn.notifies(timeout=0.05):
                seen.setdefault(int(note.payload), time.time())
            if not requests.poll():
                continue
            request = requests.recv()
            if request is None:
                return
            ids, timeout = request
            end = time.monotonic() + timeout
            while not all(i in seen for i in ids) and time.monotonic() < end:
                for note in conn.notifies(timeout=0.05, stop_after=1):
                    seen.setdefault(int(note.payload), time.time())
            requests.send({i: seen[i] for i in ids if i in seen})


class Notifications:
    """Times at which ``succeeded`` commits became visible: LISTEN on the trigger's channel,
    in a process of its own, so that the observer neither waits for the producer's GIL to
    note a time nor takes it from the producer."""

    def __init__(self, db_url: str) -> None:
        self.seen: dict[int, float] = {}
        ctx = multiprocessing.get_context("spawn")
        self._requests, theirs = ctx.Pipe()
        ready = ctx.Event()
        self._process = ctx.Process(
            target=_listen, args=(db_url, theirs, ready), name="listen", daemon=True
        )
        self._process.start()
        if not ready.wait(60):
            self._process.kill()
            raise TimeoutError("the listener process did not start")

    def wait_for(self, ids: list[int], timeout: float) -> None:
        self._requests.send((ids, timeout))
        self.seen.update(self._requests.recv())
        missing = sum(i not in self.seen for i in ids)
        if missing:
            raise TimeoutError(f"{missing} operations did not succeed in {timeout:.0f} s")

    def close(self) -> None:
        with suppress(OSError):
            self._requests.send(None)
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()


@dataclass
class LatencyResult:
    idle_ms: list[float] = field(default_factory=list)
    # one operation per transaction, P producer processes, open loop
    loaded_ms: list[float] = field(default_factory=list)
    loaded_rate: float = 0.0  # the rate the producers reached
    late_ms: list[float] = field(default_factory=list)  # commit began after its arrival time
    # the earlier reference: one producer committing whatever has arrived
    batched_ms: list[float] = field(default_factory=list)
    batched_rate: float = 0.0
    batched_per_commit: float = 0.0


def measure_latency(
    svc: Services,
    *,
    ops: int,
    rate: float,
    batched_rate: float | None,
    producers: int,
    idle: int,
    warmup: int,
) -> LatencyResult:
    """Three phases on one fresh worker (with beat), each after the one before has finished.

    1. One operation alone, ``idle`` times: commit one, wait for its receipt, wait 20 ms more.
    2. Loaded: ``ops`` operations from ``producers`` processes, one per intake transaction,
       open loop at ``rate``: operation k arrives at k / rate and is committed by process
       k mod P (how late a process began a commit is kept, so a producer that could not keep
       up shows).
    3. The earlier reference (with ``batched_rate``): ``ops`` operations open loop from this
       process, where one transaction commits every operation that has arrived (one at a time
       while the producer keeps up).

    The NOTIFY trigger is installed only now: notifying commits take a database-wide lock at
    commit, which would serialise the commits of the drain phases.
    """
    with psycopg.connect(libpq(svc.db_url), autocommit=True) as conn:
        conn.execute(NOTIFY_TRIGGER)
    result = LatencyResult()
    producer = Producer(svc.endpoints)
    notes = Notifications(svc.db_url)
    procs = ProducerProcesses(svc.endpoints, producers, ops, rate=rate)
    proc = start_settled_worker(svc, "settled-worker-latency")
    try:
        warm = procs.start()
        wait_worker(producer.app, proc)
        notes.wait_for(warm + producer.intake(warmup, 1), 60)

        for _ in range(idle):
            (op,) = producer.intake(1, 1)
            notes.wait_for([op], 30)
            result.idle_ms.append((notes.seen[op] - producer.committed_at[op]) * 1000)
            time.sleep(0.02)

        procs.go()
        intake = procs.join()
        result.loaded_rate = ops / intake.seconds
        result.late_ms = intake.late_ms
        notes.wait_for(intake.ids, 120)
        result.loaded_ms = [(notes.seen[i] - intake.committed_at[i]) * 1000 for i in intake.ids]
        if result.loaded_rate < 0.95 * rate:
            print(f"  note: the producers reached {result.loaded_rate:.0f}/s of {rate:.0f}/s")

        if batched_rate:
            ids, commits, seconds = _open_loop_batched(producer, ops, batched_rate)
            result.batched_rate = ops / seconds
            result.batched_per_commit = ops / commits
            notes.wait_for(ids, 120)
            result.batched_ms = [(notes.seen[i] - producer.committed_at[i]) * 1000 for i in ids]
    finally:
        svc.stop(proc)
        procs.close()
        notes.close()
        producer.close()
    return result


def _open_loop_batched(producer: Producer, m: int, rate: float) -> tuple[list[int], int, float]:
    """Operation k arrives at t0 + k / rate; one transaction commits every operation that has
    arrived. Returns (ids, transactions, seconds)."""
    ids: list[int] = []
    commits = 0
    t0 = time.monotonic()
    while len(ids) < m:
        due = t0 + len(ids) / rate
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        arrived = 1 + int((time.monotonic() - due) * rate)
        count = min(m - len(ids), arrived)
        ids += producer.intake(count, count)
        commits += 1
    return ids, commits, time.monotonic() - t0
