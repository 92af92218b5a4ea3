"""staff accounts of the support console, their sessions and failed sign-ins

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "staff_accounts",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("password_hash", sa.String(length=200), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("tenants", sa.JSON(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("(CURRENT_TIMESTAMP)"),
            nullable=False,
        ),
        sa.Column("disabled_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "role IN ('viewer','support','supervisor','admin')", name=op.f("ck_staff_accounts_role")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_staff_accounts")),
        sa.UniqueConstraint("name", name=op.f("uq_staff_accounts_name")),
    )
    op.create_table(
        "staff_sessions",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("account_id", ID, nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["account_id"],
            ["staff_accounts.id"],
            name=op.f("fk_staff_sessions_account_id_staff_accounts"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_staff_sessions")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_staff_sessions_token_hash")),
    )
    op.create_index("ix_staff_sessions_account_id", "staff_sessions", ["account_id"])
    op.create_table(
        "staff_login_failures",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_staff_login_failures")),
    )
    op.create_index("ix_staff_login_failures_key_at", "staff_login_failures", ["key_hash", "at"])


def downgrade() -> None:
    op.drop_index("ix_staff_login_failures_key_at", table_name="staff_login_failures")
    op.drop_table("staff_login_failures")
    op.drop_index("ix_staff_sessions_account_id", table_name="staff_sessions")
    op.drop_table("staff_sessions")
    op.drop_table("staff_accounts")
