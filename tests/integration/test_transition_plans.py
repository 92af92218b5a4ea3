"""The plans PostgreSQL picks for the one writer of transitions, on a table of some size.

``write_transitions`` unpacks its batch with ``json_to_recordset``, which the planner always
takes for 100 rows; joined to ``operations`` by id alone, on a table of a few thousand rows
(or a few tens of thousands) it hashes a sequential scan of the whole table for every
outcome written. The statement names the ids again as an array, so the rows are read by
primary key whatever the table's size.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
from sqlalchemy import Engine, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from outbox.intake import Outbox
from outbox.storage.postgres import WRITE_TRANSITIONS

GOOD = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(n for child in plan.get("Plans", []) for n in nodes(child))]


def test_an_outcome_reads_its_operations_by_primary_key_on_a_table_of_thousands(
    pg: Engine, pg_url: str, outbox: Outbox
) -> None:
    with Session(pg) as s, s.begin():
        op = outbox.enqueue(s, tenant="acme", op_id="op-1", kind="refund", params=GOOD).id
        s.execute(
            text(
                "INSERT INTO operations (tenant, op_id, kind, params, fingerprint,"
                " fingerprint_key_version, idempotency_key, state, attempts, max_attempts,"
                " deadline, next_attempt_at, lease_version) SELECT tenant, 'op-old-' || g,"
                " kind, params, fingerprint, fingerprint_key_version, idempotency_key,"
                " 'succeeded', 1, max_attempts, deadline, next_attempt_at, 1"
                " FROM operations, generate_series(1, 5000) AS g WHERE op_id = 'op-1'"
            )
        )
    with pg.connect() as conn:
        conn.execute(text("ANALYZE operations"))
        conn.commit()
    row = {"id": op, "lease_version": 1, "from_state": "submitted", "to_state": "succeeded",
           "reason": None, "release": True, "note": None, "evidence": "null", "number": 1,
           "proof": "done", "status_code": None, "detail": "{}"}  # fmt: skip
    for parts in (frozenset(), frozenset({"start_attempts"}), frozenset({"finish_attempts"})):
        statement = WRITE_TRANSITIONS[parts].compile(dialect=postgresql.dialect())
        params = {"rows": json.dumps([row]), "ids": [op], "actor": "w1"}
        with psycopg.connect(pg_url.replace("+psycopg", "")) as conn:
            (plan,) = conn.execute(f"EXPLAIN (FORMAT JSON) {statement}", params).fetchone()
        on_operations = [
            n for n in nodes(plan[0]["Plan"]) if n.get("Relation Name") == "operations"
        ]
        scans = {n["Node Type"] for n in on_operations if n["Node Type"] != "ModifyTable"}
        assert scans and scans <= {"Index Scan", "Bitmap Heap Scan"}, (parts, scans)
