"""review_items.effect: a review item for an orphan effect (the downstream holds an effect under
one of Settled's keys with no operation here: ``settled ops audit``), named by the downstream,
the tenant and its reference, at most once; such an item has no operation

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("review_items", schema=None) as batch_op:
        batch_op.add_column(sa.Column("effect", sa.String(length=300), nullable=True))
        batch_op.alter_column(
            "operation_id",
            existing_type=sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            nullable=True,
        )
        batch_op.create_index("uq_review_items_effect", ["effect"], unique=True)


def downgrade() -> None:
    op.execute("DELETE FROM review_items WHERE operation_id IS NULL")
    with op.batch_alter_table("review_items", schema=None) as batch_op:
        batch_op.drop_index("uq_review_items_effect")
        batch_op.alter_column(
            "operation_id",
            existing_type=sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            nullable=False,
        )
        batch_op.drop_column("effect")
