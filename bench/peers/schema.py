"""The peers' tables in the bench's throwaway database (standard library and psycopg only, so
that the peers' own environment can import it): a refund row the app commits, and a receipt
row the peer's worker writes. The receipt has no unique key on the refund, so that a second
receipt would be seen by the judgement instead of being refused."""

from __future__ import annotations

import json
from typing import Any

#: The refund every peer sends (the simulator's refund kind; one minor unit).
PARAMS = {"order_id": "B-1", "amount_minor": 1, "currency": "CNY", "payee": "P-1"}


def refund_post(key: str, api_key: str) -> dict[str, Any]:
    """The keyword arguments of an httpx ``post`` of the refund with idempotency key ``key``
    (a client whose base URL is the simulator's)."""
    return {
        "url": "/v1/refunds",
        "content": json.dumps(PARAMS, separators=(",", ":")).encode(),
        "headers": {
            "Authorization": f"Bearer {api_key}",
            "Idempotency-Key": key,
            "Content-Type": "application/json",
        },
    }


#: system name -> the ``peer`` column's value
NAMES = {"celery_safe": "celery-safe", "procrastinate": "procrastinate", "dbos": "dbos"}

TABLES = """
CREATE TABLE IF NOT EXISTS peer_refunds (
    id bigserial PRIMARY KEY,
    peer text NOT NULL,
    idempotency_key text NOT NULL UNIQUE,
    params jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS peer_receipts (
    id bigserial PRIMARY KEY,
    peer text NOT NULL,
    refund_id bigint NOT NULL REFERENCES peer_refunds (id),
    reference text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS peer_receipts_refund ON peer_receipts (refund_id);
"""


def insert_refund(conn: Any, peer: str, key: str, params: dict[str, Any]) -> int:
    """The app's row, in the caller's transaction."""
    row = conn.execute(
        "INSERT INTO peer_refunds (peer, idempotency_key, params) VALUES (%s, %s, %s) RETURNING id",
        (peer, key, json.dumps(params)),
    ).fetchone()
    return int(row[0])


def record_receipt(conn: Any, peer: str, refund_id: int, reference: str) -> None:
    """The receipt, in one transaction of its own; none if the refund has one already (a
    redelivered task)."""
    with conn.transaction():
        conn.execute(
            "INSERT INTO peer_receipts (peer, refund_id, reference)"
            " SELECT %s, %s, %s WHERE NOT EXISTS"
            " (SELECT 1 FROM peer_receipts WHERE refund_id = %s)",
            (peer, refund_id, reference, refund_id),
        )
