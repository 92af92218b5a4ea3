"""The simulator's durable ledger: tenants, orders, tickets, business effects, idempotency records.

The ledger is the ground truth tests judge by: every business effect is one row in ``effects``,
written in the same transaction as the idempotency record that will replay it.

A submit must be cheap (the simulator shares the benchmark's cores with the system under test):
a fresh one costs one read and then one transaction (business rows, effect, saved result); the
tenants are cached and a key in flight is marked in memory.

Its parts, one concern each:

- ``schema``: the tables, and the receipt object and id prefix of each kind;
- ``statements``: every statement, compiled once, and the one connection they run on;
- ``records``: the idempotency records and the keys in flight;
- ``business``: executing a request (business rules, effect, receipt, saved result);
- ``queries``: the ground truth as JSON.

``Ledger`` puts them together; its every public method is atomic (it holds the lock for its
whole transaction).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import StaticPool

from settled.simulator.ledger import queries
from settled.simulator.ledger.business import (
    UNSCRIPTED,
    Business,
    BusinessRefusal,
    Execution,
    Scripted,
)
from settled.simulator.ledger.records import Record, Records
from settled.simulator.ledger.schema import OBJECTS, kind_of_object
from settled.simulator.ledger.statements import Database, run

__all__ = [
    "OBJECTS",
    "BusinessRefusal",
    "Execution",
    "Ledger",
    "Record",
    "Scripted",
    "engine_for",
    "key_digest",
    "kind_of_object",
]


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
        self._db = Database(engine)
        self._records = Records(self._db)
        self._business = Business(self._db, self._records)
        #: key digest -> tenant; None: load on the next lookup
        self._tenants: dict[str, str] | None = None

    def close(self) -> None:
        self._db.close()

    def reset(self) -> None:
        """Empty every table and forget the keys in flight."""
        db = self._db
        with db.transaction() as cur:
            for sql in db.sql.clear:
                run(cur, sql)
            self._tenants = None
            self._records.clear_marks()

    # -- tenants and orders (the control API sets them up) -------------------------------

    def add_tenant(self, tenant: str, api_key: str) -> None:
        db = self._db
        with db.transaction() as cur:
            self._tenants = None
            run(cur, db.sql.tenant_delete, tenant=tenant)
            run(cur, db.sql.tenant_insert, tenant=tenant, kd=key_digest(api_key))

    def tenant_for(self, api_key: str) -> str | None:
        digest = key_digest(api_key)
        db = self._db
        with db.lock:
            if self._tenants is None:
                with db.transaction() as cur:
                    rows = run(cur, db.sql.tenants).fetchall()
                self._tenants = {str(stored): str(tenant) for stored, tenant in rows}
            return self._tenants.get(digest)

    def create_order(
        self, tenant: str, order_id: str, amount_minor: int, currency: str, status: str
    ) -> None:
        db = self._db
        with db.transaction() as cur:
            run(cur, db.sql.order_delete, tenant=tenant, order_id=order_id)
            run(
                cur,
                db.sql.order_insert,
                tenant=tenant,
                order_id=order_id,
                amount=amount_minor,
                ccy=currency,
                st=status,
            )

    def order(self, tenant: str, order_id: str) -> tuple[int, str] | None:
        """The amount and currency ``order_id`` was charged (None: no such order)."""
        db = self._db
        with db.transaction() as cur:
            row = run(cur, db.sql.order, tenant=tenant, order_id=order_id).fetchone()
        return None if row is None else (int(row[0]), str(row[1]))

    def unmake_refund(self, tenant: str, reference: str) -> None:
        """Undo refund ``reference``'s effect: the provider failed or canceled it and the money
        went back (the Stripe mode's ``failed`` and ``canceled``); its record stays."""
        db = self._db
        with db.transaction() as cur:
            row = run(cur, db.sql.effect_of, tenant=tenant, reference=reference).fetchone()
            if row is None:
                return
            params = json.loads(row[0])
            order_id = params["order_id"]
            order = run(cur, db.sql.order, tenant=tenant, order_id=order_id).fetchone()
            if order is not None:
                left = max(int(order[3]) - int(params["amount_minor"]), 0)
                run(cur, db.sql.order_refunded, tenant=tenant, order_id=order_id, r=left)
            run(cur, db.sql.effect_delete, tenant=tenant, reference=reference)

    def order_currency(self, tenant: str, order_id: str) -> str | None:
        """The currency ``order_id`` was charged in (None: no such order)."""
        db = self._db
        with db.transaction() as cur:
            row = run(cur, db.sql.order, tenant=tenant, order_id=order_id).fetchone()
        return None if row is None else str(row[1])

    def order_amount(self, tenant: str, order_id: str) -> int | None:
        """The amount ``order_id`` was charged, in minor units (None: no such order)."""
        db = self._db
        with db.transaction() as cur:
            row = run(cur, db.sql.order, tenant=tenant, order_id=order_id).fetchone()
        return None if row is None else int(row[0])

    def outcomes(self, tenant: str) -> list[tuple[float, dict[str, Any]]]:
        """Every saved outcome of ``tenant`` (what lookups answer), newest first, with its
        creation time: the Stripe mode's list of refunds is made from them."""
        db = self._db
        with db.transaction() as cur:
            rows = run(cur, db.sql.record_outcomes, tenant=tenant).fetchall()
        return [(float(created), json.loads(outcome)) for created, outcome in rows]

    # -- idempotency records ------------------------------------------------------------

    def record(self, tenant: str, key: str, *, not_before: float | None) -> Record | None:
        """The record of ``key``; None if absent or created before ``not_before`` (forgotten)."""
        return self._records.get(tenant, key, not_before=not_before)

    def begin(self, tenant: str, key: str, fingerprint: str, now: float) -> None:
        """Mark ``key`` in flight (replacing a forgotten or unsaved record)."""
        self._records.begin(tenant, key, fingerprint, now)

    def forget(self, tenant: str, key: str) -> None:
        """Drop the record of ``key`` (a request that ended before executing saves nothing)."""
        self._records.forget(tenant, key)

    def in_flight(self) -> list[dict[str, str]]:
        with self._db.transaction() as cur:
            return self._records.in_flight(cur)

    # -- execution and the ground truth -------------------------------------------------

    def execute(
        self,
        *,
        tenant: str,
        kind: str,
        key: str,
        fingerprint: str,
        params: Mapping[str, Any],
        now: float,
        scripted: Scripted = UNSCRIPTED,
    ) -> Execution:
        """Run the business operation and save its result for ``key``, in one transaction
        (``scripted``: what a fault changes in it). The key's in-flight mark ends with it."""
        return self._business.execute(
            tenant=tenant,
            kind=kind,
            key=key,
            fingerprint=fingerprint,
            params=params,
            now=now,
            scripted=scripted,
        )

    def snapshot(self) -> dict[str, Any]:
        """Every effect, order and ticket, and the keys in flight (JSON-safe)."""
        return queries.snapshot(self._db, self._records)
