"""attempts.not_after: the latest an attempt may be on the wire; close review items whose
operation was settled while they stayed open

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("not_after", sa.DateTime(timezone=True), nullable=True))
    # Items opened for an operation that later left "unknown" (requeued, or settled by a
    # lookup) could never be closed: settle them with their operation.
    op.execute(
        "UPDATE review_items SET resolved_at = CURRENT_TIMESTAMP, resolved_by = 'migration:0003',"
        " version = version + 1,"
        ' resolution = \'{"by": "migration", "settled_with_operation": true}\''
        " WHERE resolved_at IS NULL AND operation_id IN"
        " (SELECT id FROM operations WHERE state <> 'unknown')"
    )


def downgrade() -> None:
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_column("not_after")
