"""The app's commit latency while its broker is down (issue 45): one producer in this process
commits one refund per intake transaction, open loop at ``rate`` per second, while a worker
(with beat: the sweeper) runs; ``seconds`` with Redis answering, ``seconds`` with it frozen
(SIGSTOP: the kernel still accepts connections, Redis answers nothing), ``seconds`` with it
answering again (the app's breaker closes) and ``seconds`` with it refusing connections
(killed, then started again on its port, empty). Each outage ends on a timer, ``seconds``
after it began, whatever the producer is doing (a commit that waits on Redis waits until
then; the commits due meanwhile follow at once, and count late). The latency is the
app's own: from opening the transaction to its commit returning, the hint's publish after the
commit included. Then every refund of the three windows is judged: one effect at the simulator
and one receipt each. The Redis is the phase's own, on a free port: never the one a run shares.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import psycopg
from prometheus_client import REGISTRY

from bench.phases.common import Services, libpq, poll, start_settled_worker, wait_worker
from bench.phases.intake import Producer
from bench.phases.live import SETTLED, Judgement, judge
from outbox.breaker import OUTCOMES
from tests.support.stack import RedisProcess

#: the windows, in the order they run
WINDOWS = ("normal", "frozen", "back", "refusing")
#: the windows with Redis down: how each begins, and ends
FAULTS = {
    "frozen": (RedisProcess.freeze, RedisProcess.thaw),
    "refusing": (RedisProcess.stop, RedisProcess.start),
}
OUTAGES = tuple(FAULTS)


@dataclass
class BrokerFaultsResult:
    latency_ms: dict[str, list[float]]  # by window: each commit's, hint included
    late_ms: dict[str, list[float]]  # by window: how long after its arrival each commit began
    hints: dict[str, float]  # settled_hints_total by outcome, over the windows
    settled_after: float  # seconds from Redis back to the last refund succeeded
    judgement: Judgement


def hint_counts() -> dict[str, float]:
    return {o: REGISTRY.get_sample_value("settled_hints_total", {"outcome": o}) or 0.0
            for o in OUTCOMES}  # fmt: skip


def _commit_for(
    producer: Producer, rate: float, seconds: float
) -> tuple[list[int], list[float], list[float]]:
    """Refund k committed at k / rate from now, for ``seconds``: ids, latencies, lateness."""
    ids: list[int] = []
    latency: list[float] = []
    late: list[float] = []
    t0 = time.monotonic()
    for k in range(round(rate * seconds)):
        due = t0 + k / rate
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        began = time.monotonic()
        late.append((began - due) * 1000)
        ids += producer.intake(1, 1)
        latency.append((time.monotonic() - began) * 1000)
    return ids, latency, late


def _all_succeeded(db_url: str, ids: list[int]) -> bool:
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM operations WHERE id = ANY(%s) AND state = 'succeeded'", (ids,)
        ).fetchone()
    return row is not None and row[0] == len(ids)


def measure_broker_faults(
    svc: Services, redis: RedisProcess, *, rate: float, seconds: float, warm: int
) -> BrokerFaultsResult:
    """The windows on ``svc`` (whose broker is ``redis``), then the judgement."""
    worker = start_settled_worker(svc, "settled-worker-faults")
    producer = Producer(svc.endpoints, tag="f")
    try:
        wait_worker(producer.app, worker)
        warmed = producer.intake(warm, 1)
        poll(lambda: _all_succeeded(svc.db_url, warmed), 60, "the warm-up refunds", 0.05)
        before = hint_counts()
        latency: dict[str, list[float]] = {}
        late: dict[str, list[float]] = {}
        ids: list[int] = []
        for window in WINDOWS:
            print(f"    {window}: {rate:g} commits/s for {seconds:g} s ...", flush=True)
            over = None
            if window in FAULTS:
                begin, end = FAULTS[window]
                begin(redis)
                over = threading.Timer(seconds, end, args=(redis,))
                over.start()
            got, latency[window], late[window] = _commit_for(producer, rate, seconds)
            ids += got
            if over is not None:
                over.join()
        back = time.monotonic()
        poll(lambda: _all_succeeded(svc.db_url, ids), 600, "every refund to succeed", 0.1)
        settled_after = time.monotonic() - back
        after = hint_counts()
    finally:
        producer.close()
        svc.stop(worker)
    return BrokerFaultsResult(
        latency_ms=latency,
        late_ms=late,
        hints={o: after[o] - before[o] for o in OUTCOMES},
        settled_after=settled_after,
        judgement=judge(svc, SETTLED, ids),
    )
