"""The Procrastinate peer (run in the peers' own environment, ``bench.peers.external``).

The app commits the refund row and defers the job in the same transaction (Procrastinate's
``configure(connection=...)``: the job is the outbox); the worker (one process, ``--concurrency``
jobs at once, LISTEN/NOTIFY on) POSTs the refund with the refund's stable key and writes the
receipt row in one transaction of its own, none if the refund has one already.

``python -m bench.peers.procrastinate_peer schema``: Procrastinate's schema, if the database
has none; ``... worker --concurrency C``: the worker; the producer side is ``Feed``
(``bench.peers.feed``). It reads ``SETTLED_DATABASE_URL``, ``SETTLED_DOWNSTREAM_URL`` and
``BENCH_API_KEY``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from typing import Any

import httpx
import procrastinate
import psycopg

from bench.peers.schema import NAMES, PARAMS, insert_refund, refund_post

PEER = NAMES["procrastinate"]
RECEIPT = (
    "INSERT INTO peer_receipts (peer, refund_id, reference)"
    " SELECT %(peer)s, %(refund_id)s, %(reference)s WHERE NOT EXISTS"
    " (SELECT 1 FROM peer_receipts WHERE refund_id = %(refund_id)s)"
)


def libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(conninfo=libpq(os.environ["SETTLED_DATABASE_URL"]))
)
_http: dict[str, httpx.AsyncClient] = {}


@app.task(name="bench_peer_refund", retry=procrastinate.RetryStrategy(max_attempts=20, wait=0))
async def refund(refund_id: int, key: str) -> None:
    client = _http.get("client")
    if client is None:
        client = _http["client"] = httpx.AsyncClient(
            base_url=os.environ["SETTLED_DOWNSTREAM_URL"], timeout=5.0, trust_env=False
        )
    response = await client.post(**refund_post(key, os.environ["BENCH_API_KEY"]))
    response.raise_for_status()  # a 409 (the key in flight) or a 5xx: retried
    await app.connector.execute_query_async(
        RECEIPT, peer=PEER, refund_id=refund_id, reference=str(response.json().get("id", ""))
    )


class Feed:
    """The app side: the refund row and its job in one transaction."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.conn = psycopg.connect(libpq(cfg["db_url"]))
        self.app = app.with_connector(procrastinate.SyncPsycopgConnector(
            conninfo=libpq(cfg["db_url"]), min_size=1, max_size=1,
        ))  # fmt: skip
        self.app.open()
        self.task = self.app.tasks["bench_peer_refund"]
        self.commits = 0

    def commit_one(self) -> tuple[int, float]:
        key = f"pc-{uuid.uuid4().hex}"
        refund_id = insert_refund(self.conn, PEER, key, PARAMS)
        self.task.configure(connection=self.conn).defer(refund_id=refund_id, key=key)
        self.conn.commit()
        self.commits += 1
        return refund_id, time.time()

    def close(self) -> None:
        self.conn.close()
        self.app.close()


def apply_schema(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT to_regclass('procrastinate_jobs')").fetchone()
        if row and row[0]:
            return
        conn.execute(app.schema_manager.get_schema())


async def work(concurrency: int) -> None:
    async with app.open_async():
        await app.run_worker_async(concurrency=concurrency, install_signal_handlers=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["schema", "worker"])
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--pool", default=None, help="ignored: one process, asyncio")
    parser.add_argument("--hostname", default=None, help="ignored")
    args = parser.parse_args()
    apply_schema(libpq(os.environ["SETTLED_DATABASE_URL"]))
    if args.command == "worker":
        asyncio.run(work(args.concurrency))


if __name__ == "__main__":
    main()
