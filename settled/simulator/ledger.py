"""The simulator's durable ledger: tenants, orders, tickets, business effects, idempotency records.

The ledger is the ground truth tests judge by: every business effect is one row in ``effects``,
written in the same transaction as the idempotency record that will replay it.

The simulator shares the benchmark's cores with the system under test, so a submit must be
cheap: every statement is a Core statement compiled once for the engine's dialect and run on one
DBAPI connection the ledger holds; tenants are cached; a key in flight is marked in memory. A
fresh submit costs one read and then one transaction (business rows, effect, saved result).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine.interfaces import DBAPICursor
from sqlalchemy.pool import StaticPool
from sqlalchemy.sql.compiler import SQLCompiler

from outbox import wire

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


class _Sql:
    """A Core statement compiled once for a dialect, with its parameters in the driver's order."""

    __slots__ = ("constants", "names", "text")

    def __init__(self, statement: sa.ClauseElement, dialect: sa.Dialect) -> None:
        compiled = cast(SQLCompiler, statement.compile(dialect=dialect))
        self.text: str = compiled.string
        #: positional paramstyles (SQLite's ``?``): the bind names in order; None: by name
        self.names = tuple(compiled.positiontup or ()) if compiled.positional else None
        #: the values written into the statement (``status="open"``), by bind name
        self.constants = {
            name: bind.value for bind, name in compiled.bind_names.items() if not bind.required
        }

    def args(self, params: Mapping[str, Any]) -> Sequence[Any] | Mapping[str, Any]:
        if self.constants:
            params = {**self.constants, **params}
        return params if self.names is None else tuple(params[name] for name in self.names)


class _Statements:
    """Every statement the ledger runs, compiled for one dialect."""

    def __init__(self, dialect: sa.Dialect) -> None:
        b = sa.bindparam

        def sql(statement: sa.ClauseElement) -> _Sql:
            return _Sql(statement, dialect)

        at_tenant = tenants.c.tenant == b("tenant")
        at_order = (orders.c.tenant == b("tenant"), orders.c.order_id == b("order_id"))
        at_ticket = (tickets.c.tenant == b("tenant"), tickets.c.ticket_id == b("ticket_id"))
        at_key = (records.c.tenant == b("tenant"), records.c.idempotency_key == b("key"))
        result: dict[str, Any] = {
            "fingerprint": b("fp"),
            "state": b("state"),
            "created": b("now"),
            "response_status": b("status"),
            "response_body": b("body"),
            "response_headers": b("headers"),
            "outcome": b("outcome"),
        }
        self.tenants = sql(sa.select(tenants.c.key_digest, tenants.c.tenant))
        self.tenant_delete = sql(tenants.delete().where(at_tenant))
        self.tenant_insert = sql(tenants.insert().values(tenant=b("tenant"), key_digest=b("kd")))
        self.order_delete = sql(orders.delete().where(*at_order))
        self.order_insert = sql(
            orders.insert().values(
                tenant=b("tenant"),
                order_id=b("order_id"),
                amount_minor=b("amount"),
                currency=b("ccy"),
                status=b("st"),
                refunded_minor=0,
            )
        )
        self.order = sql(
            sa.select(
                orders.c.amount_minor, orders.c.currency, orders.c.status, orders.c.refunded_minor
            ).where(*at_order)
        )
        self.order_refunded = sql(orders.update().where(*at_order).values(refunded_minor=b("r")))
        self.ticket = sql(sa.select(tickets.c.status, tickets.c.pickup).where(*at_ticket))
        self.ticket_insert = sql(
            tickets.insert().values(
                tenant=b("tenant"), ticket_id=b("ticket_id"), order_id=b("order_id"), status="open"
            )
        )
        self.ticket_pickup = sql(tickets.update().where(*at_ticket).values(pickup=b("pickup")))
        self.ticket_cancel = sql(tickets.update().where(*at_ticket).values(status="cancelled"))
        self.effect_insert = sql(
            effects.insert().values(
                tenant=b("tenant"),
                idempotency_key=b("key"),
                kind=b("kind"),
                reference=b("reference"),
                params=b("params"),
                created=b("now"),
            )
        )
        self.record = sql(
            sa.select(
                records.c.fingerprint,
                records.c.state,
                records.c.created,
                records.c.response_status,
                records.c.response_body,
                records.c.response_headers,
                records.c.outcome,
            ).where(*at_key)
        )
        self.record_update = sql(records.update().where(*at_key).values(**result))
        self.record_insert = sql(
            records.insert().values(tenant=b("tenant"), idempotency_key=b("key"), **result)
        )
        self.record_delete = sql(records.delete().where(*at_key))
        self.records_in_flight = sql(
            sa.select(records.c.tenant, records.c.idempotency_key).where(
                records.c.state == "in_flight"
            )
        )
        self.effects = sql(
            sa.select(
                effects.c.tenant,
                effects.c.idempotency_key,
                effects.c.kind,
                effects.c.reference,
                effects.c.params,
                effects.c.created,
            ).order_by(effects.c.id)
        )
        self.orders = sql(
            sa.select(
                orders.c.tenant,
                orders.c.order_id,
                orders.c.amount_minor,
                orders.c.currency,
                orders.c.status,
                orders.c.refunded_minor,
            )
        )
        self.tickets = sql(
            sa.select(
                tickets.c.tenant,
                tickets.c.ticket_id,
                tickets.c.order_id,
                tickets.c.status,
                tickets.c.pickup,
            )
        )
        self.clear = [sql(table.delete()) for table in reversed(metadata.sorted_tables)]


@dataclass(frozen=True)
class _Mark:
    """A key in flight: its request is between the idempotency check and its saved result."""

    fingerprint: str
    created: float


class Ledger:
    """All reads and writes of the simulator's database; one lock serialises them.

    Every public method is atomic: it holds the lock for its whole transaction, on the one
    connection the ledger keeps (so no statement ever waits for a pool, and SQLite ``:memory:``
    and file ledgers behave alike).

    A key in flight is marked in memory, not in the database: a request in flight lives only as
    long as this process, and nothing it did is committed before its result is saved (execution
    and result commit together), so after a restart the key is rightly free again.
    """

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        self._lock = threading.RLock()
        metadata.create_all(engine)
        self._sql = _Statements(engine.dialect)
        self._conn = engine.raw_connection()
        #: key digest -> tenant; None: load on the next lookup
        self._tenants: dict[str, str] | None = None
        self._in_flight: dict[tuple[str, str], _Mark] = {}

    def close(self) -> None:
        with self._lock:
            self._conn.close()
        self._engine.dispose()

    @contextmanager
    def _transaction(self) -> Iterator[DBAPICursor]:
        """A cursor in one transaction, under the lock: committed, or rolled back on error."""
        with self._lock:
            cursor = self._conn.cursor()
            try:
                yield cursor
            except BaseException:
                self._conn.rollback()
                raise
            else:
                self._conn.commit()
            finally:
                cursor.close()

    def _run(self, cursor: DBAPICursor, sql: _Sql, **params: Any) -> DBAPICursor:
        cursor.execute(sql.text, sql.args(params))
        return cursor

    def reset(self) -> None:
        with self._transaction() as cur:
            for sql in self._sql.clear:
                self._run(cur, sql)
            self._tenants = None
            self._in_flight.clear()

    # -- tenants ------------------------------------------------------------------------

    def add_tenant(self, tenant: str, api_key: str) -> None:
        with self._transaction() as cur:
            self._tenants = None
            self._run(cur, self._sql.tenant_delete, tenant=tenant)
            self._run(cur, self._sql.tenant_insert, tenant=tenant, kd=key_digest(api_key))

    def tenant_for(self, api_key: str) -> str | None:
        digest = key_digest(api_key)
        with self._lock:
            if self._tenants is None:
                with self._transaction() as cur:
                    rows = self._run(cur, self._sql.tenants).fetchall()
                self._tenants = {str(stored): str(tenant) for stored, tenant in rows}
            return self._tenants.get(digest)

    # -- orders -------------------------------------------------------------------------

    def create_order(
        self, tenant: str, order_id: str, amount_minor: int, currency: str, status: str
    ) -> None:
        with self._transaction() as cur:
            self._run(cur, self._sql.order_delete, tenant=tenant, order_id=order_id)
            self._run(
                cur,
                self._sql.order_insert,
                tenant=tenant,
                order_id=order_id,
                amount=amount_minor,
                ccy=currency,
                st=status,
            )

    # -- idempotency records ------------------------------------------------------------

    def record(self, tenant: str, key: str, *, not_before: float | None) -> Record | None:
        """The record of ``key``; None if absent or created before ``not_before`` (forgotten)."""
        with self._lock:
            mark = self._in_flight.get((tenant, key))
            if mark is not None:
                if not_before is not None and mark.created < not_before:
                    return None
                return Record(mark.fingerprint, "in_flight", mark.created, None, None)
            with self._transaction() as cur:
                row = self._run(cur, self._sql.record, tenant=tenant, key=key).fetchone()
        if row is None:
            return None
        fp, state, created, status, body, headers, outcome = row
        if not_before is not None and created < not_before:
            return None
        response = None
        if status is not None:
            response = Response(status, json.loads(body), json.loads(headers))
        return Record(fp, state, created, response, json.loads(outcome) if outcome else None)

    def begin(self, tenant: str, key: str, fingerprint: str, now: float) -> None:
        """Mark ``key`` in flight (replacing a forgotten or unsaved record)."""
        with self._lock:
            self._in_flight[(tenant, key)] = _Mark(fingerprint, now)

    def forget(self, tenant: str, key: str) -> None:
        """Drop the record of ``key`` (a request that ended before executing saves nothing)."""
        with self._transaction() as cur:
            self._in_flight.pop((tenant, key), None)
            self._run(cur, self._sql.record_delete, tenant=tenant, key=key)

    def in_flight(self) -> list[dict[str, str]]:
        with self._transaction() as cur:
            return self._keys_in_flight(cur)

    def _keys_in_flight(self, cur: DBAPICursor) -> list[dict[str, str]]:
        # Records of older ledgers may still say "in_flight": such a key stays in use.
        rows = self._run(cur, self._sql.records_in_flight).fetchall()
        marks = list(self._in_flight)
        keys = [(str(tenant), str(key)) for tenant, key in rows]
        keys += [mark for mark in marks if mark not in keys]
        return [{"tenant": tenant, "idempotency_key": key} for tenant, key in keys]

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
        """Run the business operation and save its result for ``key``, in one transaction.

        The key's in-flight mark ends with the transaction, committed or not.
        """
        obj, prefix = OBJECTS[kind]
        try:
            with self._transaction() as cur:
                try:
                    if reject_code is not None:
                        raise BusinessRefusal(reject_code, "declined by a scripted fault")
                    self._apply(cur, tenant, kind, params)
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
                    self._run(
                        cur,
                        self._sql.effect_insert,
                        tenant=tenant,
                        key=key,
                        kind=kind,
                        reference=reference,
                        params=json.dumps(dict(params), sort_keys=True),
                        now=now,
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
                saved = json.dumps(outcome)
                self._save(
                    cur,
                    tenant=tenant,
                    key=key,
                    fp=fingerprint,
                    state="done",
                    now=now,
                    status=response.status,
                    body=saved if response.body is outcome else json.dumps(response.body),
                    headers=json.dumps(dict(response.headers)),
                    outcome=saved,
                )
        finally:
            with self._lock:
                self._in_flight.pop((tenant, key), None)
        return Execution(response, outcome)

    def _save(self, cur: DBAPICursor, **values: Any) -> None:
        """Replace the record of ``key`` (one record per key and tenant)."""
        if self._run(cur, self._sql.record_update, **values).rowcount == 0:
            self._run(cur, self._sql.record_insert, **values)

    def _apply(self, cur: DBAPICursor, tenant: str, kind: str, p: Mapping[str, Any]) -> None:
        sql = self._sql
        if kind == "refund":
            self._refund(cur, tenant, p)
        elif kind == "after_sales_ticket":
            if self._run(cur, sql.order, tenant=tenant, order_id=p["order_id"]).fetchone() is None:
                raise BusinessRefusal("order_not_found", "no such order")
            if self._run(cur, sql.ticket, tenant=tenant, ticket_id=p["ticket_id"]).fetchone():
                raise BusinessRefusal("ticket_exists", "a ticket with this id exists")
            self._run(
                cur,
                sql.ticket_insert,
                tenant=tenant,
                ticket_id=p["ticket_id"],
                order_id=p["order_id"],
            )
        elif kind == "pickup":
            _, pickup = self._open_ticket(cur, tenant, p["ticket_id"])
            if pickup is not None:
                raise BusinessRefusal("pickup_exists", "a pickup is already scheduled")
            self._run(
                cur,
                sql.ticket_pickup,
                tenant=tenant,
                ticket_id=p["ticket_id"],
                pickup=f"{p['day']} {p['slot']}",
            )
        elif kind == "ticket_cancel":
            self._open_ticket(cur, tenant, p["ticket_id"])
            self._run(cur, sql.ticket_cancel, tenant=tenant, ticket_id=p["ticket_id"])
        else:  # pragma: no cover - the server only routes known kinds
            raise ValueError(kind)

    def _refund(self, cur: DBAPICursor, tenant: str, p: Mapping[str, Any]) -> None:
        order_id = p["order_id"]
        order = self._run(cur, self._sql.order, tenant=tenant, order_id=order_id).fetchone()
        if order is None:
            raise BusinessRefusal("order_not_found", "no such order")
        amount_minor, currency, status, refunded_minor = order
        if status != "open":
            raise BusinessRefusal("order_closed", "the order is closed")
        if currency != p["currency"]:
            raise BusinessRefusal("currency_mismatch", "the order was charged in another currency")
        if refunded_minor + p["amount_minor"] > amount_minor:
            raise BusinessRefusal("amount_exceeds_refundable", "more than the refundable amount")
        self._run(
            cur,
            self._sql.order_refunded,
            tenant=tenant,
            order_id=order_id,
            r=refunded_minor + p["amount_minor"],
        )

    def _open_ticket(self, cur: DBAPICursor, tenant: str, ticket_id: str) -> tuple[str, Any]:
        """The (status, pickup) of an open ticket; a business refusal if none is open."""
        ticket = self._run(cur, self._sql.ticket, tenant=tenant, ticket_id=ticket_id).fetchone()
        if ticket is None:
            raise BusinessRefusal("ticket_not_found", "no such ticket")
        status, pickup = ticket
        if status != "open":
            raise BusinessRefusal("ticket_not_open", "the ticket is cancelled")
        return str(status), pickup

    # -- ground truth -------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Every effect, order and ticket, and the keys in flight (JSON-safe)."""
        with self._transaction() as cur:
            effect_rows = self._run(cur, self._sql.effects).fetchall()
            order_rows = self._run(cur, self._sql.orders).fetchall()
            ticket_rows = self._run(cur, self._sql.tickets).fetchall()
            in_flight = self._keys_in_flight(cur)
        return {
            "effects": [
                {
                    "tenant": tenant,
                    "idempotency_key": key,
                    "kind": kind,
                    "reference": reference,
                    "params": json.loads(params),
                    "created": created,
                }
                for tenant, key, kind, reference, params, created in effect_rows
            ],
            "orders": [
                {
                    "tenant": tenant,
                    "order_id": order_id,
                    "amount_minor": amount_minor,
                    "currency": currency,
                    "status": status,
                    "refunded_minor": refunded_minor,
                }
                for tenant, order_id, amount_minor, currency, status, refunded_minor in order_rows
            ],
            "tickets": [
                {
                    "tenant": tenant,
                    "ticket_id": ticket_id,
                    "order_id": order_id,
                    "status": status,
                    "pickup": pickup,
                }
                for tenant, ticket_id, order_id, status, pickup in ticket_rows
            ],
            "in_flight": in_flight,
        }


def _other_value(value: object) -> object:
    """A value that differs from ``value`` (for mismatched receipts)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{value}-X"
    return value + 1
