"""The references Celery itself sets: a no-op drain, and a task's publish-to-start latency."""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import dataclass, field

import redis
from celery import Celery

from bench.noop_app import NOOP, STARTED, product_app, stock_app, transport_name
from bench.phases.common import Broker, Services, pause, poll, resume, wait_worker
from settled.celery_app import QUEUE


@dataclass
class NoopResult:
    drain_per_second: float
    transport: str  # the broker transport class, by its full name
    start_ms: list[float] = field(default_factory=list)  # publish-to-start, one at a time


def measure_noop(svc: Services, n: int, *, stock: bool, idle: int) -> NoopResult:
    """No-op tasks per second drained by a worker with ``svc``'s pool and concurrency, with the
    product's Celery configuration or stock Celery (``bench/noop_app.py``); then, on the same
    worker, idle, ``idle`` tasks published one at a time: the time from just before the publish
    to the start of the task's body.

    The drain: tasks are queued while the worker's consumer is paused, and the clock runs from
    resuming it until none is queued or unacknowledged (acks_late: acknowledged when done).
    """
    name = "noop-stock" if stock else "noop-product"
    app = stock_app(svc.broker_url) if stock else product_app(svc.settings())
    broker = Broker(svc.broker_url)
    proc = svc.spawn(
        name,
        [sys.executable, "-m", "bench.noop_app", f"--concurrency={svc.concurrency}",
         f"--pool={svc.pool}", f"--hostname=bench-{name}@%h", *(["--stock"] if stock else [])],
    )  # fmt: skip
    try:
        wait_worker(app, proc)
        for i in range(2 * svc.concurrency):  # warm every child
            app.send_task(NOOP, args=[[i]], queue=QUEUE)
        poll(lambda: broker.pending() == 0, 30, "the warm-up no-ops")
        pause(app)
        for i in range(n):
            app.send_task(NOOP, args=[[i]], queue=QUEUE)
        queued = broker.pending()
        started = time.monotonic()
        resume(app)
        poll(lambda: broker.pending() == 0, 300, "the no-op drain", 0.002)
        elapsed = time.monotonic() - started
        if queued < n:
            print(f"  note: {n - queued} no-ops were consumed before the pause took effect")
        result = NoopResult(queued / elapsed, transport_name(app))
        result.start_ms = publish_to_start(app, broker.client, idle)
        return result
    finally:
        svc.stop(proc)
        app.close()
        broker.close()


def publish_to_start(
    app: Celery, client: redis.Redis[bytes], count: int, gap: float = 0.02
) -> list[float]:
    """Milliseconds from just before publishing a ``bench.started`` task to the start of its
    body, one task at a time, each after the previous one started and ``gap`` seconds more (the
    worker has acknowledged it and waits for the next message)."""
    key = f"bench:started:{uuid.uuid4().hex}"
    times: list[float] = []
    for _ in range(count):
        sent = time.time()
        app.send_task(STARTED, args=[key], queue=QUEUE)
        got = client.blpop([key], timeout=30)
        if got is None:
            raise TimeoutError("a bench.started task did not start in 30 s")
        times.append((float(got[1]) - sent) * 1000)
        time.sleep(gap)
    client.delete(key)
    return times
