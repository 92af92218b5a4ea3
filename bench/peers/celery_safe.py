"""The plain Celery "safe" peer: what a careful team writes without an outbox.

The app commits the refund row (with a stable idempotency key) in its own transaction and
publishes a task after the commit; the task (acks_late, prefetch 1, JSON: the product's
delivery settings, stock Celery and kombu's Redis transport) POSTs the refund to the simulator
with that key and writes the receipt row in the same database, one transaction, once
(``ON CONFLICT DO NOTHING``: a redelivered task adds no second receipt).

Run as ``python -m bench.peers.celery_safe --concurrency C [--pool P]``: a worker with exactly
the flags ``settled worker`` uses. It reads the bench's environment (``SETTLED_DATABASE_URL``,
``SETTLED_BROKER_URL``, ``SETTLED_DOWNSTREAM_URL``, ``BENCH_API_KEY``); the producer side is
``Feed`` (``bench.peers.feed``).
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from typing import Any

import httpx
import psycopg
from celery import Celery

from bench.peers.schema import NAMES, PARAMS, insert_refund, record_receipt, refund_post
from settled.celery_app import DELIVERY, QUEUE, worker_argv

PEER = NAMES["celery_safe"]
TASK = "bench.peer.refund"


def libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def make_app(broker_url: str) -> Celery:
    app = Celery("bench-celery-safe", broker=broker_url, set_as_current=False)
    app.conf.update(
        **DELIVERY,
        task_default_queue=QUEUE,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )
    # One HTTP client and one database connection per worker process (prefork children fork).
    local: dict[str, Any] = {}

    @app.task(  # type: ignore[untyped-decorator]
        name=TASK, ignore_result=True, shared=False, bind=True,
        autoretry_for=(httpx.TransportError, psycopg.OperationalError),
        retry_backoff=0.05, max_retries=20,
    )  # fmt: skip
    def refund(self: Any, refund_id: int, key: str) -> None:
        if local.get("pid") != os.getpid():
            local.clear()
            local["pid"] = os.getpid()
            local["http"] = httpx.Client(base_url=os.environ["SETTLED_DOWNSTREAM_URL"],
                                         timeout=5.0, trust_env=False)  # fmt: skip
            local["db"] = psycopg.connect(libpq(os.environ["SETTLED_DATABASE_URL"]))
        response = local["http"].post(**refund_post(key, os.environ["BENCH_API_KEY"]))
        if response.status_code >= 500 or response.status_code == 409:
            raise self.retry(countdown=0.05)  # the key in flight, or the downstream failed
        response.raise_for_status()
        record_receipt(local["db"], PEER, refund_id, str(response.json().get("id", "")))

    return app


class Feed:
    """The app side: the refund row committed, then the task published (after commit)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.app = make_app(cfg["broker_url"])
        self.conn = psycopg.connect(libpq(cfg["db_url"]))
        self.commits = 0

    def commit_one(self) -> tuple[int, float]:
        key = f"cs-{uuid.uuid4().hex}"
        refund_id = insert_refund(self.conn, PEER, key, PARAMS)
        self.conn.commit()
        self.commits += 1
        at = time.time()
        self.app.send_task(TASK, args=[refund_id, key], queue=QUEUE)
        return refund_id, at

    def close(self) -> None:
        self.conn.close()
        self.app.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--pool", default="prefork")
    parser.add_argument("--hostname", default=None)
    args = parser.parse_args()
    app = make_app(os.environ["SETTLED_BROKER_URL"])
    app.worker_main(
        worker_argv(beat=False, pool=args.pool, concurrency=args.concurrency,
                    loglevel="WARNING", hostname=args.hostname)
    )  # fmt: skip


if __name__ == "__main__":
    main()
