"""operations, attempts, events, runs, review items

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("tenant", sa.String(length=63), nullable=False),
        sa.Column("handle", sa.String(length=64), nullable=False),
        sa.Column("title", sa.String(length=200), nullable=True),
        sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancelled_by", sa.String(length=100), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("(CURRENT_TIMESTAMP)"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.UniqueConstraint("handle", name=op.f("uq_runs_handle")),
    )
    op.create_table(
        "operations",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("tenant", sa.String(length=63), nullable=False),
        sa.Column("op_id", sa.String(length=80), nullable=False),
        sa.Column("kind", sa.String(length=40), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("fingerprint_key_version", sa.String(length=20), nullable=False),
        sa.Column("idempotency_key", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.String(length=32), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("deadline", sa.DateTime(timezone=True), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("first_sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("unknown_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lookups", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("lease_owner", sa.String(length=100), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lease_version", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("correlation_id", sa.String(length=200), nullable=True),
        sa.Column(
            "compensates_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True
        ),
        sa.Column("receipt", sa.JSON(), nullable=True),
        sa.Column("downstream_ref", sa.String(length=200), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("(CURRENT_TIMESTAMP)"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("(CURRENT_TIMESTAMP)"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "(state = 'rejected') = (reason IS NOT NULL)",
            name=op.f("ck_operations_reason_iff_rejected"),
        ),
        sa.CheckConstraint(
            "reason IS NULL OR reason IN ('business_rejected','invalid_params','permission_denied','not_executed')",
            name=op.f("ck_operations_reason"),
        ),
        sa.CheckConstraint(
            "state IN ('planned','submitted','succeeded','rejected','unknown','cancelled')",
            name=op.f("ck_operations_state"),
        ),
        sa.CheckConstraint(
            "attempts >= 0 AND max_attempts >= 1", name=op.f("ck_operations_budget")
        ),
        sa.ForeignKeyConstraint(
            ["compensates_id"],
            ["operations.id"],
            name=op.f("fk_operations_compensates_id_operations"),
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_operations_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_operations")),
        sa.UniqueConstraint("tenant", "op_id", name="uq_operations_tenant_op_id"),
    )
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.create_index(
            "ix_operations_due",
            ["next_attempt_at"],
            unique=False,
            postgresql_where=sa.text("state = 'planned'"),
            sqlite_where=sa.text("state = 'planned'"),
        )
        batch_op.create_index("ix_operations_run_id", ["run_id"], unique=False)
        batch_op.create_index(
            "ix_operations_unresolved",
            ["lease_until"],
            unique=False,
            postgresql_where=sa.text("state IN ('submitted', 'unknown')"),
            sqlite_where=sa.text("state IN ('submitted', 'unknown')"),
        )

    op.create_table(
        "attempts",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column(
            "operation_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("lease_version", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(length=100), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("proof", sa.String(length=16), nullable=True),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(
            ["operation_id"], ["operations.id"], name=op.f("fk_attempts_operation_id_operations")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempts")),
        sa.UniqueConstraint("operation_id", "number", name=op.f("uq_attempts_operation_id_number")),
    )
    op.create_table(
        "operation_events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column(
            "operation_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("from_state", sa.String(length=16), nullable=True),
        sa.Column("to_state", sa.String(length=16), nullable=False),
        sa.Column("actor", sa.String(length=100), nullable=False),
        sa.Column("lease_version", sa.Integer(), nullable=True),
        sa.Column("reason", sa.String(length=64), nullable=True),
        sa.Column("evidence", sa.JSON(), nullable=True),
        sa.Column(
            "at",
            sa.DateTime(timezone=True),
            server_default=sa.text("(CURRENT_TIMESTAMP)"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["operation_id"],
            ["operations.id"],
            name=op.f("fk_operation_events_operation_id_operations"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_operation_events")),
    )
    with op.batch_alter_table("operation_events", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_operation_events_operation_id"), ["operation_id"], unique=False
        )

    op.create_table(
        "review_items",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column(
            "operation_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("tenant", sa.String(length=63), nullable=False),
        sa.Column("reason", sa.String(length=64), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("(CURRENT_TIMESTAMP)"),
            nullable=False,
        ),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("resolved_by", sa.String(length=100), nullable=True),
        sa.Column("resolution", sa.JSON(), nullable=True),
        sa.Column("note", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["operation_id"],
            ["operations.id"],
            name=op.f("fk_review_items_operation_id_operations"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_review_items")),
    )
    with op.batch_alter_table("review_items", schema=None) as batch_op:
        batch_op.create_index(
            "uq_review_items_open",
            ["operation_id"],
            unique=True,
            postgresql_where=sa.text("resolved_at IS NULL"),
            sqlite_where=sa.text("resolved_at IS NULL"),
        )


def downgrade() -> None:
    with op.batch_alter_table("review_items", schema=None) as batch_op:
        batch_op.drop_index(
            "uq_review_items_open",
            postgresql_where=sa.text("resolved_at IS NULL"),
            sqlite_where=sa.text("resolved_at IS NULL"),
        )

    op.drop_table("review_items")
    with op.batch_alter_table("operation_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_operation_events_operation_id"))

    op.drop_table("operation_events")
    op.drop_table("attempts")
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.drop_index(
            "ix_operations_unresolved",
            postgresql_where=sa.text("state IN ('submitted', 'unknown')"),
            sqlite_where=sa.text("state IN ('submitted', 'unknown')"),
        )
        batch_op.drop_index("ix_operations_run_id")
        batch_op.drop_index(
            "ix_operations_due",
            postgresql_where=sa.text("state = 'planned'"),
            sqlite_where=sa.text("state = 'planned'"),
        )

    op.drop_table("operations")
    op.drop_table("runs")
