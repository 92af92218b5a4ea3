"""downstream_clock_lags: a downstream's clock measured behind the database's beyond the clock
margin, as a process saw it (the deadline fence allows for it; counted and alerted)

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "downstream_clock_lags",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("detected_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("downstream", sa.String(length=100), nullable=False),
        sa.Column("lag_seconds", sa.Float(), nullable=False),
        sa.Column("begins", sa.Boolean(), nullable=False),
        sa.Column("detected_by", sa.String(length=100), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_downstream_clock_lags")),
    )
    op.create_index(
        "ix_downstream_clock_lags_downstream_detected_at",
        "downstream_clock_lags",
        ["downstream", "detected_at"],
    )


def downgrade() -> None:
    op.drop_index(
        "ix_downstream_clock_lags_downstream_detected_at", table_name="downstream_clock_lags"
    )
    op.drop_table("downstream_clock_lags")
