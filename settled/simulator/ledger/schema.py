"""The ledger's tables, and the receipt ``object`` and id prefix of each kind."""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

tenants = sa.Table(
    "sim_tenants",
    metadata,
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("key_digest", sa.String(64), nullable=False, unique=True),
)
orders = sa.Table(
    "sim_orders",
    metadata,
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("order_id", sa.String(64), primary_key=True),
    sa.Column("amount_minor", sa.BigInteger, nullable=False),
    sa.Column("currency", sa.String(3), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),  # open | closed
    sa.Column("refunded_minor", sa.BigInteger, nullable=False, default=0),
)
tickets = sa.Table(
    "sim_tickets",
    metadata,
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("ticket_id", sa.String(64), primary_key=True),
    sa.Column("order_id", sa.String(64), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),  # open | cancelled
    sa.Column("pickup", sa.String(64)),  # "day slot" once scheduled
)
effects = sa.Table(
    "sim_effects",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("tenant", sa.String(64), nullable=False),
    sa.Column("idempotency_key", sa.String(255), nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("reference", sa.String(64), nullable=False),
    sa.Column("params", sa.Text, nullable=False),
    sa.Column("created", sa.Float, nullable=False),
)
records = sa.Table(
    "sim_idempotency_records",
    metadata,
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("idempotency_key", sa.String(255), primary_key=True),
    sa.Column("fingerprint", sa.String(64), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),  # in_flight | done
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("response_status", sa.Integer),
    sa.Column("response_body", sa.Text),
    sa.Column("response_headers", sa.Text),
    sa.Column("outcome", sa.Text),  # the record the lookup answers with
)

#: kind -> (receipt ``object``, id prefix)
OBJECTS = {
    "refund": ("refund", "re_"),
    "after_sales_ticket": ("ticket", "tkt_"),
    "pickup": ("pickup", "pu_"),
    "ticket_cancel": ("ticket_cancellation", "tcx_"),
}


def kind_of_object(obj: str) -> str:
    """The kind whose receipts have ``object`` = ``obj`` ("" for none)."""
    return next((kind for kind, (name, _) in OBJECTS.items() if name == obj), "")
