"""operation_tombstones: what ``settled ops prune`` keeps of each operation it deletes, so that
a replay of a pruned ``(tenant, op_id)`` is answered from it and never creates a second
operation; on PostgreSQL, the function intake's statement asks whether a tombstone was written
while it waited (``outbox.storage.tombstones.TOMBSTONED``)

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

#: VOLATILE and PL/pgSQL (never inlined): its query takes a snapshot of its own when it runs,
#: after the intake INSERT that calls it waited for a prune holding the same (tenant, op_id),
#: so it sees that prune's tombstone once the prune committed (under READ COMMITTED).
CREATE_FUNCTION = """
CREATE FUNCTION settled_tombstoned(p_tenant text, p_op_id text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN EXISTS (
        SELECT 1 FROM operation_tombstones WHERE tenant = p_tenant AND op_id = p_op_id
    );
END
$$
"""


def upgrade() -> None:
    op.create_table(
        "operation_tombstones",
        sa.Column("tenant", sa.String(length=63), nullable=False),
        sa.Column("op_id", sa.String(length=80), nullable=False),
        sa.Column("kind", sa.String(length=40), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("fingerprint_key_version", sa.String(length=20), nullable=False),
        sa.Column("idempotency_key", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.String(length=32), nullable=True),
        sa.Column("downstream_ref", sa.String(length=200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("pruned_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "state IN ('succeeded','rejected','cancelled')",
            name=op.f("ck_operation_tombstones_state"),
        ),
        sa.PrimaryKeyConstraint("tenant", "op_id", name=op.f("pk_operation_tombstones")),
    )
    op.create_index("ix_operation_tombstones_pruned_at", "operation_tombstones", ["pruned_at"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CREATE_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION settled_tombstoned(text, text)")
    op.drop_index("ix_operation_tombstones_pruned_at", table_name="operation_tombstones")
    op.drop_table("operation_tombstones")
