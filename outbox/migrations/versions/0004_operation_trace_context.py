"""operations.trace_context: the W3C traceparent of the operation's intake, when tracing is on

Revision ID: 0004
Revises: 0003

Written and read only by ``settled.tracing`` (Core statements); the ORM model does not map it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("trace_context", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.drop_column("trace_context")
