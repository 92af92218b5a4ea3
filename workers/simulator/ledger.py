"""The simulator's durable ledger: tenants, orders, tickets, business effects, idempotency records.

The ledger is the ground truth tests judge by: every business effect is one row in ``effects``,
written in the same transaction as the idempotency record that will replay it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import StaticPool

from workers import wire

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


@dataclass(frozen=True)
class Response:
    """An HTTP answer as the idempotency layer saves and replays it."""

    status: int
    body: Mapping[str, Any]
    headers: Mapping[str, str]


@dataclass(frozen=True)
class Record:
    fingerprint: str
    state: str
    created: float
    response: Response | None
    outcome: Mapping[str, Any] | None


@dataclass(frozen=True)
class Execution:
    """What executing one request produced: the answer and the record lookups return."""

    response: Response
    outcome: Mapping[str, Any]


class BusinessRefusal(Exception):
    """The backend declined the request (not enough to refund, order closed, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def engine_for(ledger: str) -> sa.Engine:
    """An engine for a database URL, an SQLite file path, or ``:memory:``."""
    if ledger == ":memory:":
        return sa.create_engine(
            "sqlite://", poolclass=StaticPool, connect_args={"check_same_thread": False}
        )
    if "://" not in ledger:
        return sa.create_engine(f"sqlite:///{ledger}")
    return sa.create_engine(ledger)


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


class Ledger:
    """All reads and writes of the simulator's database; one lock serialises them."""

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        self._lock = threading.RLock()
        metadata.create_all(engine)

    def close(self) -> None:
        self._engine.dispose()

    def reset(self) -> None:
        with self._lock, self._engine.begin() as conn:
            for table in reversed(metadata.sorted_tables):
                conn.execute(table.delete())

    # -- tenants ------------------------------------------------------------------------

    def add_tenant(self, tenant: str, api_key: str) -> None:
        with self._lock, self._engine.begin() as conn:
            conn.execute(tenants.delete().where(tenants.c.tenant == tenant))
            conn.execute(tenants.insert().values(tenant=tenant, key_digest=key_digest(api_key)))

    def tenant_for(self, api_key: str) -> str | None:
        digest = key_digest(api_key)
        with self._lock, self._engine.connect() as conn:
            rows = conn.execute(sa.select(tenants.c.tenant, tenants.c.key_digest)).all()
        for tenant, stored in rows:
            if hmac.compare_digest(stored, digest):
                return str(tenant)
        return None

    # -- orders -------------------------------------------------------------------------

    def create_order(
        self, tenant: str, order_id: str, amount_minor: int, currency: str, status: str
    ) -> None:
        with self._lock, self._engine.begin() as conn:
            conn.execute(
                orders.delete().where(orders.c.tenant == tenant, orders.c.order_id == order_id)
            )
            conn.execute(
                orders.insert().values(
                    tenant=tenant,
                    order_id=order_id,
                    amount_minor=amount_minor,
                    currency=currency,
                    status=status,
                    refunded_minor=0,
                )
            )

    # -- idempotency records ------------------------------------------------------------

    def record(self, tenant: str, key: str, *, not_before: float | None) -> Record | None:
        """The record of ``key``; None if absent or created before ``not_before`` (forgotten)."""
        with self._lock, self._engine.connect() as conn:
            row = conn.execute(
                sa.select(records).where(
                    records.c.tenant == tenant, records.c.idempotency_key == key
                )
            ).one_or_none()
        if row is None or (not_before is not None and row.created < not_before):
            return None
        response = None
        if row.response_status is not None:
            response = Response(
                row.response_status, json.loads(row.response_body), json.loads(row.response_headers)
            )
        outcome = json.loads(row.outcome) if row.outcome else None
        return Record(row.fingerprint, row.state, row.created, response, outcome)

    def begin(self, tenant: str, key: str, fingerprint: str, now: float) -> None:
        """Mark ``key`` in flight (replacing a forgotten or unsaved record)."""
        with self._lock, self._engine.begin() as conn:
            self._save(conn, tenant, key, fingerprint, now, state="in_flight")

    def forget(self, tenant: str, key: str) -> None:
        """Drop the record of ``key`` (a request that ended before executing saves nothing)."""
        with self._lock, self._engine.begin() as conn:
            self._forget(conn, tenant, key)

    @classmethod
    def _save(
        cls,
        conn: sa.Connection,
        tenant: str,
        key: str,
        fingerprint: str,
        now: float,
        **values: Any,
    ) -> None:
        """Replace the record of ``key`` (one record per key and tenant)."""
        cls._forget(conn, tenant, key)
        conn.execute(
            records.insert().values(
                tenant=tenant, idempotency_key=key, fingerprint=fingerprint, created=now, **values
            )
        )

    @staticmethod
    def _forget(conn: sa.Connection, tenant: str, key: str) -> None:
        conn.execute(
            records.delete().where(records.c.tenant == tenant, records.c.idempotency_key == key)
        )

    def in_flight(self) -> list[dict[str, str]]:
        with self._lock, self._engine.connect() as conn:
            rows = conn.execute(
                sa.select(records.c.tenant, records.c.idempotency_key).where(
                    records.c.state == "in_flight"
                )
            ).all()
        return [{"tenant": r.tenant, "idempotency_key": r.idempotency_key} for r in rows]

    # -- execution ----------------------------------------------------------------------

    def execute(
        self,
        *,
        tenant: str,
        kind: str,
        key: str,
        fingerprint: str,
        params: Mapping[str, Any],
        now: float,
        reject_code: str | None = None,
        mismatch_field: str | None = None,
        answer_503: bool = False,
    ) -> Execution:
        """Run the business operation and save its result for ``key``, in one transaction."""
        obj, prefix = OBJECTS[kind]
        with self._lock, self._engine.begin() as conn:
            try:
                if reject_code is not None:
                    raise BusinessRefusal(reject_code, "declined by a scripted fault")
                self._apply(conn, tenant, kind, params)
            except BusinessRefusal as refusal:
                error = {
                    "type": wire.BUSINESS_ERROR,
                    "code": refusal.code,
                    "message": refusal.message,
                }
                outcome: dict[str, Any] = {
                    "id": "rej_" + secrets.token_hex(8),
                    "object": obj,
                    "status": "rejected",
                    "params": dict(params),
                    "idempotency_key": key,
                    "created": now,
                    "error": error,
                }
                response = Response(402, {"error": error}, {})
            else:
                reference = prefix + secrets.token_hex(8)
                conn.execute(
                    effects.insert().values(
                        tenant=tenant,
                        idempotency_key=key,
                        kind=kind,
                        reference=reference,
                        params=json.dumps(dict(params), sort_keys=True),
                        created=now,
                    )
                )
                echoed = dict(params)
                if mismatch_field is not None:
                    echoed[mismatch_field] = _other_value(echoed.get(mismatch_field))
                outcome = {
                    "id": reference,
                    "object": obj,
                    "status": "succeeded",
                    "params": echoed,
                    "idempotency_key": key,
                    "created": now,
                }
                response = Response(200, outcome, {})
            if answer_503:
                error = {
                    "type": wire.API_ERROR,
                    "code": "internal_error",
                    "message": "an internal error happened after processing",
                }
                response = Response(503, {"error": error}, {})
            self._save(
                conn,
                tenant,
                key,
                fingerprint,
                now,
                state="done",
                response_status=response.status,
                response_body=json.dumps(response.body),
                response_headers=json.dumps(dict(response.headers)),
                outcome=json.dumps(outcome),
            )
        return Execution(response, outcome)

    def _apply(self, conn: sa.Connection, tenant: str, kind: str, p: Mapping[str, Any]) -> None:
        if kind == "refund":
            self._refund(conn, tenant, p)
        elif kind == "after_sales_ticket":
            self._open_ticket(conn, tenant, p)
        elif kind == "pickup":
            ticket = self._open_ticket_row(conn, tenant, p["ticket_id"])
            if ticket.pickup is not None:
                raise BusinessRefusal("pickup_exists", "a pickup is already scheduled")
            conn.execute(
                tickets.update()
                .where(tickets.c.tenant == tenant, tickets.c.ticket_id == p["ticket_id"])
                .values(pickup=f"{p['day']} {p['slot']}")
            )
        elif kind == "ticket_cancel":
            self._open_ticket_row(conn, tenant, p["ticket_id"])
            conn.execute(
                tickets.update()
                .where(tickets.c.tenant == tenant, tickets.c.ticket_id == p["ticket_id"])
                .values(status="cancelled")
            )
        else:  # pragma: no cover - the server only routes known kinds
            raise ValueError(kind)

    @staticmethod
    def _refund(conn: sa.Connection, tenant: str, p: Mapping[str, Any]) -> None:
        order = conn.execute(
            sa.select(orders).where(orders.c.tenant == tenant, orders.c.order_id == p["order_id"])
        ).one_or_none()
        if order is None:
            raise BusinessRefusal("order_not_found", "no such order")
        if order.status != "open":
            raise BusinessRefusal("order_closed", "the order is closed")
        if order.currency != p["currency"]:
            raise BusinessRefusal("currency_mismatch", "the order was charged in another currency")
        if order.refunded_minor + p["amount_minor"] > order.amount_minor:
            raise BusinessRefusal("amount_exceeds_refundable", "more than the refundable amount")
        conn.execute(
            orders.update()
            .where(orders.c.tenant == tenant, orders.c.order_id == p["order_id"])
            .values(refunded_minor=order.refunded_minor + p["amount_minor"])
        )

    @staticmethod
    def _open_ticket(conn: sa.Connection, tenant: str, p: Mapping[str, Any]) -> None:
        order = conn.execute(
            sa.select(orders.c.order_id).where(
                orders.c.tenant == tenant, orders.c.order_id == p["order_id"]
            )
        ).one_or_none()
        if order is None:
            raise BusinessRefusal("order_not_found", "no such order")
        exists = conn.execute(
            sa.select(tickets.c.ticket_id).where(
                tickets.c.tenant == tenant, tickets.c.ticket_id == p["ticket_id"]
            )
        ).one_or_none()
        if exists is not None:
            raise BusinessRefusal("ticket_exists", "a ticket with this id exists")
        conn.execute(
            tickets.insert().values(
                tenant=tenant, ticket_id=p["ticket_id"], order_id=p["order_id"], status="open"
            )
        )

    @staticmethod
    def _open_ticket_row(conn: sa.Connection, tenant: str, ticket_id: str) -> sa.Row[Any]:
        ticket = conn.execute(
            sa.select(tickets).where(tickets.c.tenant == tenant, tickets.c.ticket_id == ticket_id)
        ).one_or_none()
        if ticket is None:
            raise BusinessRefusal("ticket_not_found", "no such ticket")
        if ticket.status != "open":
            raise BusinessRefusal("ticket_not_open", "the ticket is cancelled")
        return ticket

    # -- ground truth -------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Every effect, order and ticket, and the keys in flight (JSON-safe)."""
        with self._lock, self._engine.connect() as conn:
            effect_rows = conn.execute(sa.select(effects).order_by(effects.c.id)).all()
            order_rows = conn.execute(sa.select(orders)).all()
            ticket_rows = conn.execute(sa.select(tickets)).all()
        return {
            "effects": [
                {
                    "tenant": r.tenant,
                    "idempotency_key": r.idempotency_key,
                    "kind": r.kind,
                    "reference": r.reference,
                    "params": json.loads(r.params),
                    "created": r.created,
                }
                for r in effect_rows
            ],
            "orders": [
                {
                    "tenant": r.tenant,
                    "order_id": r.order_id,
                    "amount_minor": r.amount_minor,
                    "currency": r.currency,
                    "status": r.status,
                    "refunded_minor": r.refunded_minor,
                }
                for r in order_rows
            ],
            "tickets": [
                {
                    "tenant": r.tenant,
                    "ticket_id": r.ticket_id,
                    "order_id": r.order_id,
                    "status": r.status,
                    "pickup": r.pickup,
                }
                for r in ticket_rows
            ],
            "in_flight": self.in_flight(),
        }


def _other_value(value: object) -> object:
    """A value that differs from ``value`` (for mismatched receipts)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{value}-X"
    return value + 1
