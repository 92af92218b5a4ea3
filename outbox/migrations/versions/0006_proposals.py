"""proposals: operations an AI agent asked for, before and after their approval

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "proposals",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("tenant", sa.String(length=63), nullable=False),
        sa.Column("handle", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=40), nullable=False),
        sa.Column("order_ref", sa.String(length=64), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("fingerprint_key_version", sa.String(length=20), nullable=False),
        sa.Column("reason", sa.String(length=500), nullable=False),
        sa.Column("correlation_id", sa.String(length=200), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("decided_by", sa.String(length=100), nullable=True),
        sa.Column("op_id", sa.String(length=80), nullable=True),
        sa.Column("run_id", ID, nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("(CURRENT_TIMESTAMP)"),
            nullable=False,
        ),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('proposed','approved','declined','expired')",
            name=op.f("ck_proposals_status"),
        ),
        sa.CheckConstraint(
            "(status = 'approved') = (op_id IS NOT NULL)",
            name=op.f("ck_proposals_op_id_iff_approved"),
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_proposals_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_proposals")),
        sa.UniqueConstraint("handle", name=op.f("uq_proposals_handle")),
    )
    op.create_index(
        "ix_proposals_tenant_kind_order_ref", "proposals", ["tenant", "kind", "order_ref"]
    )


def downgrade() -> None:
    op.drop_index("ix_proposals_tenant_kind_order_ref", table_name="proposals")
    op.drop_table("proposals")
