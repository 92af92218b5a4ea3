"""Search indexes: the console finds an operation by its order, payee, op id, idempotency
key and downstream reference (``outbox.storage.search``) through an index each, not by
scanning every operation

On PostgreSQL the order, the payee and the references seen in attempts and events are
expression indexes on the JSON the search reads (``params ->> 'order_id'``, ...). The order
and the op id use ``text_pattern_ops``, which serves both equality and the search's
"begins with" (``LIKE 'A10%'``) whatever the database's collation. The reference indexes on
attempts and events are partial: most rows hold no reference.

SQLite gets the plain column indexes only. Its planner uses an expression index only where
the query spells the very same expression, and the search binds the JSON path as a parameter
(``JSON_EXTRACT(params, ?)``), so such an index would cost every write and serve no read.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

#: (name, table, indexed expression, partial-index condition or None), PostgreSQL only
EXPRESSIONS = (
    ("ix_operations_order_id", "operations", "(params ->> 'order_id') text_pattern_ops", None),
    ("ix_operations_payee", "operations", "(params ->> 'payee')", None),
    (
        "ix_attempts_reference", "attempts", "(detail ->> 'reference')",
        "(detail ->> 'reference') IS NOT NULL",
    ),
    (
        "ix_operation_events_reference", "operation_events", "(evidence ->> 'reference')",
        "(evidence ->> 'reference') IS NOT NULL",
    ),
    (
        "ix_operation_events_record_reference", "operation_events",
        "(evidence #>> '{record,reference}')", "(evidence #>> '{record,reference}') IS NOT NULL",
    ),
)  # fmt: skip


def upgrade() -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    op.create_index("ix_operations_downstream_ref", "operations", ["downstream_ref"])
    op.create_index("ix_operations_idempotency_key", "operations", ["idempotency_key"])
    op.create_index(
        "ix_operations_op_id", "operations", ["op_id"],
        postgresql_ops={"op_id": "text_pattern_ops"},
    )  # fmt: skip
    if postgresql:
        for name, table, expression, where in EXPRESSIONS:
            partial = f" WHERE {where}" if where else ""
            op.execute(f"CREATE INDEX {name} ON {table} ({expression}){partial}")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for name, _, _, _ in EXPRESSIONS:
            op.execute(f"DROP INDEX {name}")
    op.drop_index("ix_operations_op_id", table_name="operations")
    op.drop_index("ix_operations_idempotency_key", table_name="operations")
    op.drop_index("ix_operations_downstream_ref", table_name="operations")
