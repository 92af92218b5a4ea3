"""Benchmark-only Celery app: the product's Celery configuration plus a no-op task.

Run as ``python -m bench.noop_app --concurrency C``: a prefork worker with exactly the flags
``settled worker`` uses (``settled.celery_app.worker_argv``), so the drain rate of ``bench.noop``
is the ceiling Celery itself puts on the pipeline.
"""

from __future__ import annotations

import argparse

from outbox.settings import Settings
from settled.celery_app import create_app, worker_argv

NOOP = "bench.noop"

app = create_app(Settings())


@app.task(name=NOOP, ignore_result=True)  # type: ignore[untyped-decorator]
def noop(operation_id: int) -> None:
    """Takes the same argument as ``settled.submit`` and does nothing with it."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--pool", default="prefork")
    parser.add_argument("--loglevel", default="WARNING")
    parser.add_argument("--hostname", default=None)
    args = parser.parse_args()
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
