"""The console's searches use migration 0013's indexes on PostgreSQL: with twenty thousand
operations, the plan of a search by order, by payee and by downstream reference reads the
index of that key (a search by order reads no other operation: no ``Seq Scan``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.orm import Session

from outbox.kinds import default_registry
from outbox.storage.search import operations_by, operations_matching

ROWS = 20000
KINDS = default_registry()

#: 20000 refunds, fifty to a run; each with a finished attempt that names its reference and an
#: event of a lookup that found it (most events of a real table name none: one in ten here)
FILL = (
    "INSERT INTO runs (tenant, handle) SELECT 'acme', 'run-' || g FROM generate_series(1, 400) g",
    "INSERT INTO operations (tenant, op_id, kind, params, fingerprint, fingerprint_key_version,"
    " idempotency_key, state, attempts, max_attempts, deadline, next_attempt_at, lease_version,"
    " downstream_ref, run_id)"
    " SELECT 'acme', 'op-' || g, 'refund', json_build_object('order_id', 'A' || g,"
    " 'amount_minor', 100, 'currency', 'CNY', 'payee', 'P-' || g), 'f', 'v1', 'key-' || g,"
    " 'succeeded', 1, 5, now(), now(), 0, 're_' || g, 1 + g % 400"
    f" FROM generate_series(1, {ROWS}) g",
    "INSERT INTO attempts (operation_id, number, lease_version, started_at, detail)"
    " SELECT id, 1, 1, now(), json_build_object('reference', 'at_' || id) FROM operations",
    "INSERT INTO operation_events (operation_id, from_state, to_state, actor, evidence)"
    " SELECT id, 'planned', 'submitted', 'worker', CASE WHEN id % 10 = 0 THEN"
    " json_build_object('reference', 'ev_' || id, 'record', json_build_object('reference',"
    " 'rec_' || id)) ELSE json_build_object('attempt', 1) END FROM operations",
    "ANALYZE",
)


@pytest.fixture
def filled(pg: Engine) -> Engine:
    with pg.begin() as conn:
        for statement in FILL:
            conn.execute(text(statement))
    return pg


@pytest.fixture
def plans(filled: Engine) -> Iterator[list[str]]:
    """The plan of every SELECT on operations run meanwhile: EXPLAIN of the very statement
    and parameters the driver is given."""
    found: list[str] = []

    def explain(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().startswith("SELECT") and "FROM operations" in statement:
            cursor.execute("EXPLAIN " + statement, parameters)
            found.append("\n".join(row[0] for row in cursor.fetchall()))

    event.listen(filled, "before_cursor_execute", explain)
    try:
        yield found
    finally:
        event.remove(filled, "before_cursor_execute", explain)


def uses(plan: str, index: str) -> bool:
    return f"Index Scan using {index} " in plan or f"Bitmap Index Scan on {index} " in plan


def test_a_search_by_order_reads_the_order_index(filled: Engine, plans: list[str]) -> None:
    with Session(filled) as s:
        found = operations_by(s, "order_id", "A42", kinds=KINDS, tenants=None)
    assert [op.op_id for op in found] == ["op-42"]
    assert uses(plans[0], "ix_operations_order_id"), plans[0]
    assert "Seq Scan on operations" not in plans[0], plans[0]


@pytest.mark.parametrize(
    ("q", "op_id", "matched", "index"),
    [
        ("A19999", "op-19999", ["order_id"], "ix_operations_order_id"),
        ("P-19999", "op-19999", ["payee"], "ix_operations_payee"),
        ("re_19999", "op-19999", ["reference"], "ix_operations_downstream_ref"),
        ("at_19999", "op-19999", ["reference"], "ix_attempts_reference"),
        ("ev_19990", "op-19990", ["reference"], "ix_operation_events_reference"),
        ("rec_19990", "op-19990", ["reference"], "ix_operation_events_record_reference"),
    ],
)
def test_a_free_text_search_reads_each_key_s_index(
    filled: Engine, plans: list[str], q: str, op_id: str, matched: list[str], index: str
) -> None:
    with Session(filled) as s:
        found, more = operations_matching(s, q, kinds=KINDS, tenants=None, prefix=True)
    assert [(op.op_id, on) for op, on in found] == [(op_id, matched)]
    assert not more
    assert uses(plans[0], index), plans[0]
