"""Benchmark-only Celery apps with a no-op task: the product's configuration, and stock Celery.

Run as ``python -m bench.noop_app --concurrency C [--pool P] [--stock]``: a worker with exactly
the flags ``settled worker`` uses (``settled.celery_app.worker_argv``), so the drain rate of
``bench.noop`` is the ceiling Celery itself puts on the pipeline.

- the product's configuration (the default): ``settled.celery_app.create_app``, the app the
  workers run (acks_late, prefetch 1, JSON, the product's Redis transport that keeps one client
  per channel, its visibility timeout);
- ``--stock``: Celery as an app gets it out of the box with the same delivery settings
  (acks_late, reject on worker lost, prefetch 1, JSON, no result backend) and kombu's own
  Redis transport, none of the product's broker tweaks: the reference the issue compares with.

Two tasks: ``bench.noop`` takes the same argument as ``settled.submit`` and does nothing;
``bench.started`` pushes the time its body started (``time.time()``) onto a Redis list, which
gives the publish-to-start latency of a task.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import redis
from celery import Celery

from outbox.settings import Settings
from settled.celery_app import DELIVERY, QUEUE, create_app, worker_argv

NOOP = "bench.noop"
STARTED = "bench.started"


def _add_tasks(app: Celery, broker_url: str) -> Celery:
    clients: dict[int, redis.Redis[bytes]] = {}  # one per process (prefork children fork)

    @app.task(name=NOOP, ignore_result=True, shared=False)  # type: ignore[untyped-decorator]
    def noop(operation_ids: Any) -> None:
        """Takes the same argument as ``settled.submit`` and does nothing with it."""

    @app.task(name=STARTED, ignore_result=True, shared=False)  # type: ignore[untyped-decorator]
    def started(key: str) -> None:
        at = time.time()
        client = clients.get(os.getpid())
        if client is None:
            client = clients[os.getpid()] = redis.Redis.from_url(broker_url)
        client.rpush(key, repr(at))

    return app


def product_app(settings: Settings) -> Celery:
    """The product's Celery app (``settled.celery_app.create_app``) with the bench's tasks."""
    return _add_tasks(create_app(settings), settings.broker_url)


def stock_app(broker_url: str) -> Celery:
    """Stock Celery and kombu's own Redis transport, with the product's delivery settings."""
    app = Celery("bench-stock", broker=broker_url, set_as_current=False)
    app.conf.update(
        **DELIVERY,  # the product's delivery settings, the same object
        task_default_queue=QUEUE,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )
    return _add_tasks(app, broker_url)


def transport_name(app: Celery) -> str:
    """The broker transport class the app uses, by its full name."""
    with app.connection_for_write() as conn:
        cls = type(conn.transport)
    return f"{cls.__module__}.{cls.__qualname__}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--pool", default="prefork")
    parser.add_argument("--loglevel", default="WARNING")
    parser.add_argument("--hostname", default=None)
    parser.add_argument("--stock", action="store_true", help="stock Celery and kombu's transport")
    args = parser.parse_args()
    settings = Settings()
    app = stock_app(settings.broker_url) if args.stock else product_app(settings)
    app.worker_main(
        worker_argv(
            beat=False,
            pool=args.pool,
            concurrency=args.concurrency,
            loglevel=args.loglevel,
            hostname=args.hostname,
        )
    )


if __name__ == "__main__":
    main()
