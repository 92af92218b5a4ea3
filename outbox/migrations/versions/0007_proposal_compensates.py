"""proposals.compensates_id: an agent's request to compensate (offset) what an earlier approved
request did

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("proposals", schema=None) as batch_op:
        batch_op.add_column(sa.Column("compensates_id", ID, nullable=True))
        batch_op.create_foreign_key(
            batch_op.f("fk_proposals_compensates_id_proposals"),
            "proposals",
            ["compensates_id"],
            ["id"],
        )


def downgrade() -> None:
    with op.batch_alter_table("proposals", schema=None) as batch_op:
        batch_op.drop_constraint(
            batch_op.f("fk_proposals_compensates_id_proposals"), type_="foreignkey"
        )
        batch_op.drop_column("compensates_id")
