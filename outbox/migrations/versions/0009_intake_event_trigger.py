"""SQLite: the ``created`` event row of a new operation written by a trigger, so intake is one
statement there too (PostgreSQL writes it in the intake statement's own CTE)

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

#: The event row ``outbox.storage.postgres.created_event`` writes, the same values: from
#: nothing to the new row's state, by intake, its evidence the correlation id (JSON null
#: without one), at the row's own creation time.
CREATE = """
CREATE TRIGGER operations_created_event AFTER INSERT ON operations
BEGIN
    INSERT INTO operation_events
        (operation_id, from_state, to_state, actor, lease_version, reason, evidence, at)
    VALUES (
        NEW.id, NULL, NEW.state, 'intake', NULL, NULL,
        CASE WHEN NEW.correlation_id IS NULL THEN 'null'
             ELSE json_object('correlation_id', NEW.correlation_id) END,
        NEW.created_at
    );
END
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute(CREATE)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER operations_created_event")
