"""The ground truth as JSON: every effect, order and ticket, and the keys in flight."""

from __future__ import annotations

import json
from typing import Any

from settled.simulator.ledger.records import Records
from settled.simulator.ledger.statements import Database, run


def snapshot(db: Database, records: Records) -> dict[str, Any]:
    """Every effect, order and ticket, and the keys in flight (JSON-safe), read in one
    transaction."""
    with db.transaction() as cur:
        effect_rows = run(cur, db.sql.effects).fetchall()
        order_rows = run(cur, db.sql.orders).fetchall()
        ticket_rows = run(cur, db.sql.tickets).fetchall()
        in_flight = records.in_flight(cur)
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
