"""Executing a request: the business rules over orders and tickets, the effect row, the receipt.

An execution is one transaction: the business rows, the effect (one row in ``effects`` per
business effect, the ground truth tests judge by) and the idempotency record that will replay
the answer commit together, or not at all.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine.interfaces import DBAPICursor

from outbox import wire
from settled.simulator.ledger.records import Records
from settled.simulator.ledger.schema import OBJECTS
from settled.simulator.ledger.statements import Database, Statements, run
from settled.simulator.messages import Response, error


@dataclass(frozen=True)
class Scripted:
    """What a scripted fault changes in an execution; the default changes nothing."""

    refusal_code: str | None = None  # business_reject: a business refusal with this code
    wrong_field: str | None = None  # mismatched_receipt: the receipt echoes this field wrong
    answer_503: bool = False  # 503_after_commit: answer 503 (saved and replayed as such)
    #: 500_saved: fail before any effect, answer 500 and save it (replayed), nothing executed
    error_before_effect: bool = False


UNSCRIPTED = Scripted()


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


_INTERNAL_ERROR = error(
    503, wire.API_ERROR, "internal_error", "an internal error happened after processing"
)
_FAILED_BEFORE_EFFECT = error(
    500, wire.API_ERROR, "internal_error", "an internal error happened; the answer is saved"
)


class Business:
    """Executes requests against the ledger's orders and tickets."""

    def __init__(self, db: Database, records: Records) -> None:
        self._db = db
        self._records = records

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
        """Run the business operation and save its result for ``key``, in one transaction.

        The key's in-flight mark ends with the transaction, committed or not.
        """
        obj, prefix = OBJECTS[kind]
        db = self._db
        outcome: dict[str, Any]
        try:
            with db.transaction() as cur:
                if scripted.error_before_effect:
                    # Began executing, failed before any effect: the 500 is saved for the key
                    # (replayed as is), and no record says anything was done.
                    self._records.save(
                        cur, tenant=tenant, key=key, fingerprint=fingerprint, now=now,
                        response=_FAILED_BEFORE_EFFECT, outcome=None,
                    )  # fmt: skip
                    return Execution(_FAILED_BEFORE_EFFECT, {})
                try:
                    if scripted.refusal_code is not None:
                        raise BusinessRefusal(scripted.refusal_code, "declined by a scripted fault")
                    _RULES[kind](cur, db.sql, tenant, params)
                except BusinessRefusal as refusal:
                    outcome = _rejection(refusal, obj, key, params, now)
                    response = Response(402, {"error": outcome["error"]}, {})
                else:
                    reference = prefix + secrets.token_hex(8)
                    run(
                        cur,
                        db.sql.effect_insert,
                        tenant=tenant,
                        key=key,
                        kind=kind,
                        reference=reference,
                        params=json.dumps(dict(params), sort_keys=True),
                        now=now,
                    )
                    outcome = _receipt(reference, obj, key, params, now, scripted.wrong_field)
                    response = Response(200, outcome, {})
                if scripted.answer_503:
                    response = _INTERNAL_ERROR
                self._records.save(
                    cur,
                    tenant=tenant,
                    key=key,
                    fingerprint=fingerprint,
                    now=now,
                    response=response,
                    outcome=outcome,
                )
        finally:
            self._records.end(tenant, key)
        return Execution(response, outcome)


def _receipt(
    reference: str,
    obj: str,
    key: str,
    params: Mapping[str, Any],
    now: float,
    wrong_field: str | None,
) -> dict[str, Any]:
    echoed = dict(params)
    if wrong_field is not None:
        echoed[wrong_field] = _other_value(echoed.get(wrong_field))
    return {
        "id": reference,
        "object": obj,
        "status": "succeeded",
        "params": echoed,
        "idempotency_key": key,
        "created": now,
    }


def _rejection(
    refusal: BusinessRefusal, obj: str, key: str, params: Mapping[str, Any], now: float
) -> dict[str, Any]:
    return {
        "id": "rej_" + secrets.token_hex(8),
        "object": obj,
        "status": "rejected",
        "params": dict(params),
        "idempotency_key": key,
        "created": now,
        "error": {"type": wire.BUSINESS_ERROR, "code": refusal.code, "message": refusal.message},
    }


def _other_value(value: object) -> object:
    """A value that differs from ``value`` (for mismatched receipts)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{value}-X"
    return value + 1


# -- the business rules, one per kind -------------------------------------------------------

_Rule = Callable[[DBAPICursor, Statements, str, Mapping[str, Any]], None]


def _refund(cur: DBAPICursor, sql: Statements, tenant: str, p: Mapping[str, Any]) -> None:
    order_id = p["order_id"]
    order = run(cur, sql.order, tenant=tenant, order_id=order_id).fetchone()
    if order is None:
        raise BusinessRefusal("order_not_found", "no such order")
    amount_minor, currency, status, refunded_minor = order
    if status != "open":
        raise BusinessRefusal("order_closed", "the order is closed")
    if currency != p["currency"]:
        raise BusinessRefusal("currency_mismatch", "the order was charged in another currency")
    if refunded_minor + p["amount_minor"] > amount_minor:
        raise BusinessRefusal("amount_exceeds_refundable", "more than the refundable amount")
    run(
        cur,
        sql.order_refunded,
        tenant=tenant,
        order_id=order_id,
        r=refunded_minor + p["amount_minor"],
    )


def _open_ticket(cur: DBAPICursor, sql: Statements, tenant: str, p: Mapping[str, Any]) -> None:
    if run(cur, sql.order, tenant=tenant, order_id=p["order_id"]).fetchone() is None:
        raise BusinessRefusal("order_not_found", "no such order")
    if run(cur, sql.ticket, tenant=tenant, ticket_id=p["ticket_id"]).fetchone():
        raise BusinessRefusal("ticket_exists", "a ticket with this id exists")
    run(cur, sql.ticket_insert, tenant=tenant, ticket_id=p["ticket_id"], order_id=p["order_id"])


def _schedule_pickup(cur: DBAPICursor, sql: Statements, tenant: str, p: Mapping[str, Any]) -> None:
    _, pickup = _ticket_still_open(cur, sql, tenant, p["ticket_id"])
    if pickup is not None:
        raise BusinessRefusal("pickup_exists", "a pickup is already scheduled")
    pickup = f"{p['day']} {p['slot']}"
    run(cur, sql.ticket_pickup, tenant=tenant, ticket_id=p["ticket_id"], pickup=pickup)


def _cancel_ticket(cur: DBAPICursor, sql: Statements, tenant: str, p: Mapping[str, Any]) -> None:
    _ticket_still_open(cur, sql, tenant, p["ticket_id"])
    run(cur, sql.ticket_cancel, tenant=tenant, ticket_id=p["ticket_id"])


def _ticket_still_open(
    cur: DBAPICursor, sql: Statements, tenant: str, ticket_id: str
) -> tuple[str, Any]:
    """The (status, pickup) of an open ticket; a business refusal if none is open."""
    ticket = run(cur, sql.ticket, tenant=tenant, ticket_id=ticket_id).fetchone()
    if ticket is None:
        raise BusinessRefusal("ticket_not_found", "no such ticket")
    status, pickup = ticket
    if status != "open":
        raise BusinessRefusal("ticket_not_open", "the ticket is cancelled")
    return str(status), pickup


#: kind -> its business rule (the kinds of ``OBJECTS``; the server routes no other)
_RULES: dict[str, _Rule] = {
    "refund": _refund,
    "after_sales_ticket": _open_ticket,
    "pickup": _schedule_pickup,
    "ticket_cancel": _cancel_ticket,
}
