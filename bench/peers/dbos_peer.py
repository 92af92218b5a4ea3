"""The DBOS peer (run in the peers' own environment, ``bench.peers.external``).

The app commits the refund row, then enqueues a workflow whose id is the refund's stable key
(``DBOSClient.enqueue``: a second enqueue of the same id attaches to the first); the worker
process (``DBOS.launch``, the queue's ``worker_concurrency`` as the pool's) runs it: a step
that POSTs the refund with that key, then a datasource transaction that writes the receipt
row (DBOS records both, so a recovered workflow neither re-posts nor writes it twice).

``python -m bench.peers.dbos_peer schema``: DBOS's system tables and the datasource's, in the
bench's database; ``... worker --concurrency C``: the worker; the producer side is ``Feed``
(``bench.peers.feed``). It reads ``SETTLED_DATABASE_URL``, ``SETTLED_DOWNSTREAM_URL`` and
``BENCH_API_KEY``.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
import uuid
from typing import Any

import httpx
import psycopg
import sqlalchemy as sa
from dbos import DBOS, DBOSClient, SQLAlchemyDatasource

from bench.peers.schema import NAMES, PARAMS, insert_refund, refund_post

PEER = NAMES["dbos"]
QUEUE_NAME = "bench_refunds"
WORKFLOW = "bench_refund"
#: How often an idle worker looks for enqueued workflows, seconds.
POLL = 0.01


def urls() -> tuple[str, str]:
    """(libpq, SQLAlchemy with psycopg) URLs of the bench's database."""
    url = os.environ["SETTLED_DATABASE_URL"]
    libpq = url.replace("postgresql+psycopg://", "postgresql://", 1)
    return libpq, libpq.replace("postgresql://", "postgresql+psycopg://", 1)


def _launch(concurrency: int | None) -> None:
    _, url = urls()
    DBOS(config={"name": "bench-dbos", "system_database_url": url})
    db = SQLAlchemyDatasource.create(url)
    http = httpx.Client(base_url=os.environ["SETTLED_DOWNSTREAM_URL"], timeout=5.0,
                        trust_env=False)  # fmt: skip

    @DBOS.step(retries_allowed=True, max_attempts=20, interval_seconds=0.05)
    def post(key: str) -> str:
        response = http.post(**refund_post(key, os.environ["BENCH_API_KEY"]))
        response.raise_for_status()  # a 409 (the key in flight) or a 5xx: retried
        return str(response.json().get("id", ""))

    @db.transaction(isolation_level="READ COMMITTED")
    def record(refund_id: int, reference: str) -> None:
        db.sql_session().execute(
            sa.text(
                "INSERT INTO peer_receipts (peer, refund_id, reference)"
                " SELECT :peer, :refund_id, :reference WHERE NOT EXISTS"
                " (SELECT 1 FROM peer_receipts WHERE refund_id = :refund_id)"
            ),
            {"peer": PEER, "refund_id": refund_id, "reference": reference},
        )

    @DBOS.workflow(name=WORKFLOW)
    def refund(refund_id: int, key: str) -> None:
        record(refund_id, post(key))

    DBOS.launch()
    if concurrency is not None:  # a queue is registered in the system database: once launched
        DBOS.register_queue(QUEUE_NAME, worker_concurrency=concurrency, polling_interval_sec=POLL)


class Feed:
    """The app side: the refund row committed, then its workflow enqueued by id = key."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        libpq, url = urls()
        self.conn = psycopg.connect(libpq)
        self.engine = sa.create_engine(url)
        self.commits = 0
        sa.event.listen(self.engine, "commit", self._count)
        self.client = DBOSClient(system_database_engine=self.engine)

    def _count(self, _conn: Any) -> None:
        self.commits += 1

    def commit_one(self) -> tuple[int, float]:
        key = f"db-{uuid.uuid4().hex}"
        refund_id = insert_refund(self.conn, PEER, key, PARAMS)
        self.conn.commit()
        self.commits += 1
        at = time.time()
        self.client.enqueue(
            {"queue_name": QUEUE_NAME, "workflow_name": WORKFLOW, "workflow_id": key},
            refund_id, key,
        )  # fmt: skip
        return refund_id, at

    def close(self) -> None:
        self.client.destroy()
        self.conn.close()
        self.engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["schema", "worker"])
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--pool", default=None, help="ignored: one process, threads")
    parser.add_argument("--hostname", default=None, help="ignored")
    args = parser.parse_args()
    if args.command == "schema":
        _launch(None)
        DBOS.destroy()
        return
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    _launch(args.concurrency)
    stop.wait()
    DBOS.destroy(workflow_completion_timeout_sec=10)


if __name__ == "__main__":
    main()
