"""The simulator's Stripe mode: the part of Stripe's REST API the Stripe gateway uses, under
``/stripe`` (the SDK's ``api_base`` is the simulator's URL + ``/stripe``).

- ``POST /stripe/v1/refunds``: form-encoded ``payment_intent`` (or ``charge``), ``amount``,
  optional ``currency``, ``metadata[...]``, the ``Idempotency-Key`` header; answers Stripe's
  refund object, or Stripe's error JSON (``{"error": {"type", "code", "message", "param"}}``);
- ``GET /stripe/v1/refunds?payment_intent=...``: the payment intent's refunds, with metadata.

A refund goes through the same steps, fault rules and ledger as a submit of the documented
protocol (``submit``): the payment intent is the order, the refund's amount its amount, its
currency the order's. Only the wire format differs: the form body is read into the refund
intent, and every answer (saved ones and replays included) is written as Stripe writes it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl

from outbox import wire
from outbox.kinds import Kind, default_registry
from settled.simulator.auth import authenticate
from settled.simulator.injection import Injection
from settled.simulator.messages import Answer, Connection, Request, Response
from settled.simulator.state import Simulator
from settled.simulator.submit import claim_key

PREFIX = "/stripe"
REFUNDS = PREFIX + "/v1/refunds"
_IDEMPOTENCY_KEY = wire.IDEMPOTENCY_KEY.lower()
_REFUND: Kind = default_registry().get("refund")
#: the ledger's refusal codes -> (HTTP status, Stripe's error code, the parameter at fault)
_REFUSALS = {
    "amount_exceeds_refundable": (400, "amount_too_large", "amount"),
    "order_closed": (400, "charge_already_refunded", None),
    "order_not_found": (404, "resource_missing", "payment_intent"),
}
#: the documented protocol's error codes -> Stripe's, where they differ
_CODES = {"rate_limited": "rate_limit", "invalid_api_key": "api_key_invalid"}


def respond(sim: Simulator, request: Request, connection: Connection) -> Response:
    """The Stripe mode's answer to ``request`` (its path starts with ``PREFIX``)."""
    try:
        if request.path == REFUNDS and request.method == "POST":
            return create_refund(sim, request, connection)
        if request.path == REFUNDS and request.method == "GET":
            return list_refunds(sim, request, connection)
        return stripe_error(404, "invalid_request_error", "resource_missing", "no such route")
    except Answer as answer:
        return as_stripe(answer.response)


def create_refund(sim: Simulator, request: Request, connection: Connection) -> Response:
    """``POST /v1/refunds``: the ``submit`` steps, in Stripe's wire format."""
    tenant = authenticate(sim, request)
    key = (request.fields.get(_IDEMPOTENCY_KEY) or "").strip()
    if not key or len(key) > 255:
        # Stripe executes a request without a key; Settled never sends one, so refuse it.
        raise Answer(stripe_error(400, "invalid_request_error", "parameter_missing", "no key"))
    form = dict(parse_qsl(request.body.decode("utf-8", "replace"), keep_blank_values=True))
    number = sim.count_request("submit", tenant, key, None)
    rule = sim.faults.pick("submit", tenant, _REFUND.name, key, number)
    faults = Injection(sim, rule, connection)
    faults.before_idempotency()
    params = _intent(sim, tenant, form)
    fp = hashlib.sha256(json.dumps(form, sort_keys=True).encode()).hexdigest()
    replay = claim_key(sim, tenant, key, fp)
    if replay is not None:
        return as_stripe(faults.on_answer(replay))
    faults.before_commit()
    with faults.in_execution(_REFUND) as scripted:
        execution = sim.ledger.execute(
            tenant=tenant,
            kind=_REFUND.name,
            key=key,
            fingerprint=fp,
            params=params,
            now=sim.now(),
            scripted=scripted,
        )
    return as_stripe(faults.on_answer(execution.response))


def list_refunds(sim: Simulator, request: Request, connection: Connection) -> Response:
    """``GET /v1/refunds?payment_intent=...``: the intent's refunds, newest first, a page at a
    time as Stripe pages them (``limit`` 1-100, default 10; ``starting_after`` the last refund
    id of the page before; ``has_more`` where more follow).

    Every page is a lookup of every key it could show (each saved refund on the intent, the
    intent itself where there is none): each is counted as a lookup request, and the first
    ``lookup_unavailable`` fault drawn for any of them answers 503. Refunds are listed for as
    long as the ledger holds them (the key retention does not apply; the visibility delay does).
    """
    tenant = authenticate(sim, request)
    query = dict(parse_qsl(request.query))
    intent = query.get("payment_intent") or query.get("charge") or ""
    limit = _limit(query.get("limit"))
    if limit is None:
        return _invalid("parameter_invalid_integer", "limit")
    saved = [
        (created, outcome)
        for created, outcome in sim.ledger.outcomes(tenant)
        if outcome.get("object") == "refund" and outcome.get("params", {}).get("order_id") == intent
    ]
    keys = [str(outcome.get("idempotency_key", "")) for _, outcome in saved] or [intent]
    for key in keys:
        number = sim.count_request("lookup", tenant, key, None)
        rule = sim.faults.pick("lookup", tenant, _REFUND.name, key, number)
        Injection(sim, rule, connection).on_lookup()
    visible = sorted(
        (
            (created, outcome)
            for created, outcome in saved
            if outcome.get("status") == "succeeded"
            and sim.now() - created >= sim.switches.lookup_visibility_delay
        ),
        key=lambda shown: (-shown[0], str(shown[1]["id"])),  # newest first, ties by id
    )
    refunds = [refund_object(outcome) for _, outcome in visible]
    after = query.get("starting_after")
    if after is not None:
        ids = [refund["id"] for refund in refunds]
        if after not in ids:
            return _invalid("resource_missing", "starting_after")
        refunds = refunds[ids.index(after) + 1 :]
    page, has_more = refunds[:limit], len(refunds) > limit
    body = {"object": "list", "url": "/v1/refunds", "has_more": has_more, "data": page}
    return Response(200, body, {})


def _limit(text: str | None) -> int | None:
    """A list's ``limit``: Stripe's 1 to 100, 10 when absent (None: not one)."""
    if text is None:
        return 10
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 100:
        return None
    return int(text)


def _invalid(code: str, param: str) -> Response:
    """Stripe's 400 for a request parameter (answered as is: no ``as_stripe`` mapping)."""
    return stripe_error(400, "invalid_request_error", code, param, param=param)


def _intent(sim: Simulator, tenant: str, form: Mapping[str, str]) -> dict[str, Any]:
    """The refund intent the form asks for, with its metadata; answers Stripe's 400 or 404."""
    intent = form.get("payment_intent") or form.get("charge")
    if not intent:
        raise Answer(_missing("payment_intent"))
    amount = form.get("amount", "")
    if not amount.isascii() or not amount.isdigit() or int(amount) <= 0:
        raise Answer(
            stripe_error(400, "invalid_request_error", "parameter_invalid_integer", "amount")
        )
    currency = sim.ledger.order_currency(tenant, intent)
    if currency is None:
        raise Answer(_refused("order_not_found"))
    if form.get("currency") and form["currency"].upper() != currency:
        raise Answer(stripe_error(400, "invalid_request_error", "parameter_invalid", "currency"))
    metadata = {
        name[len("metadata[") : -1]: value
        for name, value in form.items()
        if name.startswith("metadata[") and name.endswith("]")
    }
    return {
        "order_id": intent,
        "amount_minor": int(amount),
        "currency": currency,
        "payee": metadata.get("payee", ""),
        "metadata": metadata,
    }


def refund_object(outcome: Mapping[str, Any]) -> dict[str, Any]:
    """Stripe's refund object for a saved receipt (the fields the gateway reads)."""
    params = outcome.get("params", {})
    return {
        "id": outcome["id"],
        "object": "refund",
        "amount": params.get("amount_minor"),
        "currency": str(params.get("currency", "")).lower(),
        "payment_intent": params.get("order_id"),
        "metadata": params.get("metadata", {}),
        "status": "succeeded",
        "created": int(outcome.get("created", 0)),
    }


def as_stripe(response: Response) -> Response:
    """A response of the documented protocol (a saved one too) in Stripe's wire format."""
    headers = dict(response.headers)
    if 200 <= response.status < 300:
        return Response(response.status, refund_object(response.body), headers)
    error = response.body.get("error") or {}
    code = str(error.get("code") or "")
    if response.status == 402 or error.get("type") == wire.BUSINESS_ERROR:
        status, stripe_code, param = _REFUSALS.get(code, (400, code, None))
        return stripe_error(status, "invalid_request_error", stripe_code, code, headers, param)
    if error.get("type") == wire.IDEMPOTENCY_ERROR:
        return stripe_error(response.status, "idempotency_error", code, code, headers)
    if error.get("type") == wire.PERMISSION_ERROR:
        # A restricted key without the permission: Stripe's 403 has no code.
        message = "the key does not have the required permissions for this request"
        return stripe_error(403, "invalid_request_error", "", message, headers)
    kind = "api_error" if response.status >= 500 else "invalid_request_error"
    return stripe_error(response.status, kind, _CODES.get(code, code), code, headers)


def stripe_error(
    status: int,
    type_: str,
    code: str,
    message: str,
    headers: Mapping[str, str] | None = None,
    param: str | None = None,
) -> Response:
    """An error answer in Stripe's shape."""
    error: dict[str, Any] = {"type": type_, "code": code or None, "message": message}
    if param is not None:
        error["param"] = param
    return Response(status, {"error": error}, headers or {})


def _missing(param: str) -> Response:
    return stripe_error(400, "invalid_request_error", "parameter_missing", param, param=param)


def _refused(code: str) -> Response:
    status, stripe_code, param = _REFUSALS[code]
    return stripe_error(status, "invalid_request_error", stripe_code, code, param=param)
