"""Every statement the ledger runs, compiled once, and the one connection it runs them on.

The simulator shares the benchmark's cores with the system under test, so a statement must be
cheap: each is a Core statement compiled once for the engine's dialect and run on one DBAPI
connection the ledger holds, under one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine.interfaces import DBAPICursor
from sqlalchemy.sql.compiler import SQLCompiler

from settled.simulator.ledger.schema import effects, metadata, orders, records, tenants, tickets


class Sql:
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


def run(cursor: DBAPICursor, sql: Sql, **params: Any) -> DBAPICursor:
    """Execute ``sql`` with ``params`` on ``cursor``; the cursor, to fetch from."""
    cursor.execute(sql.text, sql.args(params))
    return cursor


class Statements:
    """Every statement the ledger runs, compiled for one dialect."""

    def __init__(self, dialect: sa.Dialect) -> None:
        b = sa.bindparam

        def sql(statement: sa.ClauseElement) -> Sql:
            return Sql(statement, dialect)

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
        # tenants and orders (set up through the control API)
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
        # the business rows an execution reads and writes, and its effect
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
        at_effect = (effects.c.tenant == b("tenant"), effects.c.reference == b("reference"))
        self.effect_of = sql(sa.select(effects.c.params).where(*at_effect))
        self.effect_delete = sql(effects.delete().where(*at_effect))
        # idempotency records
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
        self.record_outcomes = sql(
            sa.select(records.c.created, records.c.outcome)
            .where(records.c.tenant == b("tenant"), records.c.outcome.is_not(None))
            .order_by(records.c.created.desc())
        )
        self.records_in_flight = sql(
            sa.select(records.c.tenant, records.c.idempotency_key).where(
                records.c.state == "in_flight"
            )
        )
        # the ground truth (snapshot)
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


class Database:
    """The ledger's one DBAPI connection, the lock that serialises its use, and its statements.

    One connection, so no statement ever waits for a pool, and SQLite ``:memory:`` and file
    ledgers behave alike.
    """

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        #: held for every transaction; reentrant, so a caller may group reads under it
        self.lock = threading.RLock()
        metadata.create_all(engine)
        self.sql = Statements(engine.dialect)
        self._conn = engine.raw_connection()

    def close(self) -> None:
        with self.lock:
            self._conn.close()
        self._engine.dispose()

    @contextmanager
    def transaction(self) -> Iterator[DBAPICursor]:
        """A cursor in one transaction, under the lock: committed, or rolled back on error."""
        with self.lock:
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
