"""The simulator's Stripe mode: the part of Stripe's REST API the Stripe gateway uses, under
``/stripe`` (the SDK's ``api_base`` is the simulator's URL + ``/stripe``), as strict as Stripe.

- ``POST /stripe/v1/refunds``: form-encoded ``payment_intent`` or ``charge``, ``amount``,
  optional ``currency``, ``reason``, ``metadata[...]`` (at most 50 keys of up to 40
  characters, values of up to 500), the ``Idempotency-Key`` header; answers Stripe's refund
  object, or Stripe's error JSON (``{"error": {"type", "code", "message", "param"}}``); an
  unknown parameter is Stripe's 400 ``parameter_unknown``;
- ``GET /stripe/v1/refunds?payment_intent=...`` (or ``charge=...``): the intent's refunds, with
  metadata; 404 ``resource_missing`` for an intent Stripe does not know;
- ``GET /stripe/v1/refunds/{id}``: one refund; ``GET /stripe/v1/payment_intents/{id}``: the
  payment intent (its amount, currency and charge).

Every answer carries Stripe's headers: ``Request-Id`` (``req_...``), ``Stripe-Version`` (the
request's, or the account's default; an invalid version is Stripe's 400), and on a ``POST``
the ``Idempotency-Key``; a replay of a saved answer carries ``Idempotent-Replayed: true`` and
``Original-Request`` (the ``Request-Id`` of the request whose answer is replayed). Errors are
saved and replayed as Stripe saves them: a 500 after the refund was made (the
``503_after_commit`` fault, answered as Stripe answers it: 500), and a 500 with no refund made
(``500_saved``); validation errors are not saved.

A refund goes through the same steps, fault rules and ledger as a submit of the documented
protocol (``submit``): the payment intent is the order (its charge ``ch_...`` the same id after
its prefix), the refund's amount its amount, its currency the order's. Only the wire format
differs: the form body is read into the refund intent, and every answer (saved ones and
replays included) is written as Stripe writes it. The ``refund_status`` fault makes the refund
with the status its ``code`` names (``pending``, ``requires_action`` or ``failed``) instead of
``succeeded``; ``SimulatorControl.move_stripe_refund`` takes it on from there (to
``succeeded``, ``failed`` or ``canceled``), as Stripe would later. Those statuses live in the
simulator's memory, beside the ledger (whose effect row is the refund Stripe made).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import replace
from datetime import date
from typing import Any
from urllib.parse import parse_qsl

from outbox import wire
from outbox.kinds import Kind, default_registry
from settled.simulator.auth import authenticate
from settled.simulator.faults import Fault
from settled.simulator.injection import Injection
from settled.simulator.messages import Answer, Connection, Request, Response
from settled.simulator.state import Simulator
from settled.simulator.submit import claim_key

PREFIX = "/stripe"
REFUNDS = PREFIX + "/v1/refunds"
INTENTS = PREFIX + "/v1/payment_intents"
#: the API version of an account that names none per request
DEFAULT_VERSION = "2026-10-28.endive"
#: refund statuses the ``refund_status`` fault may make a refund with, and where
#: ``move_stripe_refund`` may take one (Stripe cancels only a refund that requires action)
MADE_AS = frozenset({"pending", "requires_action", "failed"})
MOVES = {
    "pending": frozenset({"succeeded", "failed"}),
    "requires_action": frozenset({"pending", "succeeded", "failed", "canceled"}),
}
#: statuses of a refund whose money went back: no business effect (the ledger's effect undone)
UNMADE = frozenset({"failed", "canceled"})
#: a failed refund's ``failure_reason`` where none is named
DEFAULT_FAILURE = "declined"
#: the parameters each route takes (anything else: 400 ``parameter_unknown``); ``metadata``
#: stands for every ``metadata[...]``, ``expand`` for every ``expand[]``
CREATE_PARAMS = frozenset(
    {
        "payment_intent", "charge", "amount", "currency", "reason", "metadata", "expand",
        "instructions_email", "origin", "customer", "refund_application_fee", "reverse_transfer",
    }
)  # fmt: skip
LIST_PARAMS = frozenset(
    {"payment_intent", "charge", "limit", "starting_after", "ending_before", "created", "expand"}
)
READ_PARAMS = frozenset({"expand"})
#: Stripe's limits on metadata
METADATA_KEYS, METADATA_KEY_LENGTH, METADATA_VALUE_LENGTH = 50, 40, 500
_VERSION = re.compile(r"(\d{4})-(\d{2})-(\d{2})(?:\.[a-z]+)?", re.ASCII)
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
    """The Stripe mode's answer to ``request`` (its path starts with ``PREFIX``), with
    Stripe's headers (``Request-Id``, ``Stripe-Version``, the ``Idempotency-Key`` of a POST)."""
    headers = {"Request-Id": request_id(), "Stripe-Version": DEFAULT_VERSION}
    if request.method == "POST" and request.fields.get(_IDEMPOTENCY_KEY):
        headers["Idempotency-Key"] = request.fields[_IDEMPOTENCY_KEY].strip()
    try:
        version = _version(request)
        headers["Stripe-Version"] = version
        response = _route(sim, request, connection)
    except Refusal as refusal:
        response = refusal.response  # in Stripe's shape already
    except Answer as answer:
        response = as_stripe(answer.response)
    return replace(response, headers={**headers, **response.headers})


class Refusal(Answer):
    """Ends a request with an answer already in Stripe's shape (``stripe_error``), where
    ``Answer`` carries one of the documented protocol's, mapped by ``as_stripe``."""


def _route(sim: Simulator, request: Request, connection: Connection) -> Response:
    path, method = request.path, request.method
    if path == REFUNDS and method == "POST":
        return create_refund(sim, request, connection)
    if path == REFUNDS and method == "GET":
        return list_refunds(sim, request, connection)
    if path.startswith(REFUNDS + "/") and method == "GET":
        return retrieve_refund(sim, request, path[len(REFUNDS) + 1 :])
    if path.startswith(INTENTS + "/") and method == "GET":
        return retrieve_intent(sim, request, path[len(INTENTS) + 1 :])
    return stripe_error(404, "invalid_request_error", "resource_missing", "no such route")


def route_of(path: str) -> str:
    """A Stripe mode path as the request log shows it: an id in it (the payment intent names
    the order) as ``{id}``."""
    for route in (REFUNDS, INTENTS):
        if path.startswith(route + "/"):
            return route + "/{id}"
    return path


def request_id() -> str:
    """A new ``Request-Id`` in Stripe's shape."""
    return "req_" + secrets.token_urlsafe(10).replace("-", "a").replace("_", "b")[:14]


def original_request(tenant: str, key: str, created: float) -> str:
    """The ``Request-Id`` of the request that made a key's saved answer (derived from the
    saved record, so a replay names it after a restart too)."""
    digest = hashlib.sha256(f"{tenant}\x00{key}\x00{created!r}".encode()).hexdigest()
    return "req_" + digest[:14]


def _version(request: Request) -> str:
    """The request's ``Stripe-Version`` (the default where it names none); Stripe's 400 for
    one that is not a version."""
    named = request.fields.get("stripe-version")
    if named is None:
        return DEFAULT_VERSION
    match = _VERSION.fullmatch(named.strip())
    valid = match is not None
    if match is not None:
        try:
            date(int(match[1]), int(match[2]), int(match[3]))
        except ValueError:
            valid = False
    if not valid:
        message = f"Invalid Stripe API version: {named.strip()[:40]}"
        raise Refusal(stripe_error(400, "invalid_request_error", "", message))
    return named.strip()


def _params(pairs: list[tuple[str, str]], allowed: frozenset[str]) -> dict[str, str]:
    """A form's or a query's parameters; Stripe's 400 ``parameter_unknown`` for one the route
    does not take."""
    for name, _ in pairs:
        base = name.split("[", 1)[0]
        nested = base in ("metadata", "expand")  # metadata[...], expand[]: never bare
        if base not in allowed or ("[" in name) != nested:
            message = f"Received unknown parameter: {name}"
            error = stripe_error(
                400, "invalid_request_error", "parameter_unknown", message, param=name
            )
            raise Refusal(error)
    return dict(pairs)


def create_refund(sim: Simulator, request: Request, connection: Connection) -> Response:
    """``POST /v1/refunds``: the ``submit`` steps, in Stripe's wire format."""
    tenant = authenticate(sim, request)
    key = (request.fields.get(_IDEMPOTENCY_KEY) or "").strip()
    if not key or len(key) > 255:
        # Stripe executes a request without a key; Settled never sends one, so refuse it.
        raise Refusal(stripe_error(400, "invalid_request_error", "parameter_missing", "no key"))
    pairs = parse_qsl(request.body.decode("utf-8", "replace"), keep_blank_values=True)
    form = _params(pairs, CREATE_PARAMS)
    number = sim.count_request("submit", tenant, key, None)
    rule = sim.faults.pick("submit", tenant, _REFUND.name, key, number)
    faults = Injection(sim, rule, connection)
    faults.before_idempotency()
    params = _intent(sim, tenant, form)
    fp = hashlib.sha256(json.dumps(form, sort_keys=True).encode()).hexdigest()
    replay = claim_key(sim, tenant, key, fp)
    if replay is not None:
        return _saved(sim, tenant, key, as_stripe(faults.on_answer(replay), sim, first=True))
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
    made = rule.code if rule is not None and rule.fault is Fault.REFUND_STATUS else None
    if made in MADE_AS and execution.response.status == 200:
        reference = str(execution.outcome["id"])
        sim.stripe_refunds[reference] = {
            "first": made,
            "status": made,
            "failure_reason": DEFAULT_FAILURE if made == "failed" else None,
        }
        if made in UNMADE:
            sim.ledger.unmake_refund(tenant, reference)
        sim.note_injected(Fault.REFUND_STATUS)
    answer = as_stripe(faults.on_answer(execution.response), sim)
    return _saved(sim, tenant, key, answer, replayed=False)


def _saved(
    sim: Simulator, tenant: str, key: str, response: Response, *, replayed: bool = True
) -> Response:
    """A saved answer with the ids Stripe gives it: the first answer's ``Request-Id`` is the
    one a replay names as ``Original-Request``."""
    record = sim.ledger.record(tenant, key, not_before=None)
    if record is None or record.response is None:
        return response
    original = original_request(tenant, key, record.created)
    if replayed:
        return replace(response, headers={**response.headers, "Original-Request": original})
    return replace(response, headers={**response.headers, "Request-Id": original})


def move_refund(sim: Simulator, tenant: str, key: str, status: str, reason: str | None) -> None:
    """Move the refund made for ``key`` on to ``status``, as Stripe would later (``MOVES``);
    ValueError where it may not go there."""
    record = sim.ledger.record(tenant, key, not_before=None)
    refund_id = str(record.outcome.get("id")) if record and record.outcome else ""
    state = sim.stripe_refunds.get(refund_id)
    if state is None or status not in MOVES.get(str(state["status"]), frozenset()):
        raise ValueError(f"no refund for the key that may move to {status!r}")
    state["status"] = status
    state["failure_reason"] = (reason or DEFAULT_FAILURE) if status == "failed" else None
    if status in UNMADE:
        sim.ledger.unmake_refund(tenant, refund_id)


def retrieve_refund(sim: Simulator, request: Request, refund_id: str) -> Response:
    """``GET /v1/refunds/{id}``: the refund as it is now; 404 ``resource_missing`` if none."""
    tenant = authenticate(sim, request)
    _params(parse_qsl(request.query), READ_PARAMS)
    for _, outcome in sim.ledger.outcomes(tenant):
        ours = outcome.get("object") == "refund" and outcome.get("id") == refund_id
        if ours and outcome.get("status") == "succeeded":
            return Response(200, refund_object(outcome, sim), {})
    return _no_such("refund", refund_id, "id")


def retrieve_intent(sim: Simulator, request: Request, intent: str) -> Response:
    """``GET /v1/payment_intents/{id}``: the order as Stripe's payment intent (its amount,
    currency and charge); 404 ``resource_missing`` if there is none."""
    tenant = authenticate(sim, request)
    _params(parse_qsl(request.query), READ_PARAMS)
    order = sim.ledger.order(tenant, intent)
    if order is None:
        return _no_such("payment_intent", intent, "intent")
    amount, currency = order
    body = {
        "id": intent,
        "object": "payment_intent",
        "amount": amount,
        "amount_received": amount,
        "currency": currency.lower(),
        "latest_charge": charge_of(intent),
        "status": "succeeded",
    }
    return Response(200, body, {})


def charge_of(intent: str) -> str:
    """The id of the charge of payment intent ``intent`` (``pi_X`` -> ``ch_X``)."""
    return "ch_" + intent.removeprefix("pi_")


def _intent_of(sim: Simulator, tenant: str, charge: str) -> str | None:
    """The payment intent (the order) charge ``charge`` belongs to (None: Stripe knows none)."""
    if not charge.startswith("ch_"):
        return None
    rest = charge.removeprefix("ch_")
    for intent in ("pi_" + rest, rest):
        if sim.ledger.order_currency(tenant, intent) is not None:
            return intent
    return None


def _no_such(what: str, name: str, param: str) -> Response:
    message = f"No such {what}: '{name[:60]}'"
    return stripe_error(404, "invalid_request_error", "resource_missing", message, param=param)


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
    query = _params(parse_qsl(request.query), LIST_PARAMS)
    intent = _listed_intent(sim, tenant, query)
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
    refunds = [refund_object(outcome, sim) for _, outcome in visible]
    after = query.get("starting_after")
    if after is not None:
        ids = [refund["id"] for refund in refunds]
        if after not in ids:
            return _invalid("resource_missing", "starting_after")
        refunds = refunds[ids.index(after) + 1 :]
    page, has_more = refunds[:limit], len(refunds) > limit
    body = {"object": "list", "url": "/v1/refunds", "has_more": has_more, "data": page}
    return Response(200, body, {})


def _listed_intent(sim: Simulator, tenant: str, query: Mapping[str, str]) -> str:
    """The payment intent a list is filtered by (by itself or by its charge); Stripe's 404
    ``resource_missing`` for one it does not know (an unfiltered list is not served)."""
    if query.get("charge"):
        intent = _intent_of(sim, tenant, query["charge"])
        if intent is None:
            raise Refusal(_no_such("charge", query["charge"], "charge"))
        if query.get("payment_intent") not in (None, intent):
            raise Refusal(_invalid("parameter_invalid", "charge"))
        return intent
    intent = query.get("payment_intent") or ""
    if not intent:
        raise Refusal(_missing("payment_intent"))
    if sim.ledger.order_currency(tenant, intent) is None:
        raise Refusal(_no_such("payment_intent", intent, "payment_intent"))
    return intent


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
    intent = form.get("payment_intent")
    if form.get("charge"):
        by_charge = _intent_of(sim, tenant, form["charge"])
        if by_charge is None:
            raise Refusal(_no_such("charge", form["charge"], "charge"))
        if intent not in (None, "", by_charge):
            raise Refusal(_invalid("parameter_invalid", "charge"))
        intent = by_charge
    if not intent:
        raise Refusal(_missing("payment_intent"))
    amount = form.get("amount", "")
    if not amount.isascii() or not amount.isdigit() or int(amount) <= 0:
        raise Refusal(
            stripe_error(400, "invalid_request_error", "parameter_invalid_integer", "amount")
        )
    currency = sim.ledger.order_currency(tenant, intent)
    if currency is None:
        raise Refusal(_refused("order_not_found"))
    if form.get("currency") and form["currency"].upper() != currency:
        raise Refusal(stripe_error(400, "invalid_request_error", "parameter_invalid", "currency"))
    metadata = {
        name[len("metadata[") : -1]: value
        for name, value in form.items()
        if name.startswith("metadata[") and name.endswith("]")
    }
    _check_metadata(metadata)
    return {
        "order_id": intent,
        "amount_minor": int(amount),
        "currency": currency,
        "payee": metadata.get("payee", ""),
        "metadata": metadata,
    }


def _check_metadata(metadata: Mapping[str, str]) -> None:
    """Stripe's limits on metadata: 50 keys, a key of up to 40 characters, a value of up to
    500; its 400 otherwise (nothing is saved for the key)."""
    if len(metadata) > METADATA_KEYS:
        raise Refusal(_invalid("parameter_invalid", "metadata"))
    for name, value in metadata.items():
        if not name or len(name) > METADATA_KEY_LENGTH or len(value) > METADATA_VALUE_LENGTH:
            raise Refusal(_invalid("parameter_invalid", f"metadata[{name[:60]}]"))


def refund_object(
    outcome: Mapping[str, Any], sim: Simulator | None = None, *, first: bool = False
) -> dict[str, Any]:
    """Stripe's refund object for a saved receipt (the fields the gateway reads): its status
    now, or (``first``) the one it was made with, as a saved answer replays it."""
    params = outcome.get("params", {})
    state = sim.stripe_refunds.get(str(outcome["id"])) if sim is not None else None
    status = "succeeded" if state is None else state["first" if first else "status"]
    reason = None if state is None or status != "failed" else state["failure_reason"]
    intent = params.get("order_id")
    return {
        "id": outcome["id"],
        "object": "refund",
        "amount": params.get("amount_minor"),
        "currency": str(params.get("currency", "")).lower(),
        "payment_intent": intent,
        "charge": charge_of(str(intent)) if intent else None,
        "metadata": params.get("metadata", {}),
        "status": status,
        "failure_reason": reason,
        "created": int(outcome.get("created", 0)),
    }


def as_stripe(response: Response, sim: Simulator | None = None, *, first: bool = False) -> Response:
    """A response of the documented protocol (a saved one too) in Stripe's wire format."""
    headers = dict(response.headers)
    if 200 <= response.status < 300:
        body = refund_object(response.body, sim, first=first)
        return Response(response.status, body, headers, response.pace)
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
    if response.status >= 500 and code == "internal_error":
        # Stripe's error after it began executing is a 500 (saved, and replayed as such).
        return stripe_error(500, "api_error", "", "an error occurred on Stripe's end", headers)
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
