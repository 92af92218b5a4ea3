"""The simulator's Alipay mode: the part of Alipay's OpenAPI gateway the Alipay gateway uses,
written from Alipay's public documentation, at ``/alipay/gateway.do``.

A request is a form POST (the common parameters in the body or the query string, as the SDKs
send them): ``app_id``, ``method``, ``charset``, ``sign_type`` ``RSA2``, ``timestamp``,
``version`` ``1.0``, ``biz_content`` (JSON) and ``sign``, RSA-SHA256 by the app's private key
over the other non-empty parameters sorted by name as ``name=value&...``. An app is registered
with its public key through the control API (``alipay_apps``); the mode's own key pair is made
at its first use and signs every answer: ``{"<method>_response": {...}, "sign": "..."}``, the
signature over the node's exact text (``GET /_control/alipay_keys`` gives the public key).

- ``alipay.trade.refund`` (``out_trade_no``, ``refund_amount`` in yuan, ``out_request_no``):
  the same steps, fault rules and ledger as a submit of the documented protocol (``submit``),
  keyed by ``out_request_no``. A repeat of a refund number answers ``10000`` with
  ``fund_change`` ``N`` (no money moved this time); the same number with other parameters
  ``40004 ACQ.DISCORDANT_REPEAT_REQUEST``.
- ``alipay.trade.fastpay.refund.query`` (``out_trade_no``, ``out_request_no``): the refund with
  ``refund_status`` ``REFUND_SUCCESS``, or, for one not made (refused, never received, or not
  visible yet: the ``lookup_visibility_delay`` switch, a refund still processing), an answer
  with neither ``refund_status`` nor ``refund_amount``. Refunds are shown for as long as the
  ledger holds them (the key retention does not apply).

Faults answer in Alipay's shape: ``business_reject`` a ``40004`` business refusal, ``403``
``40006 isv.insufficient-isv-permissions``, ``503_after_commit`` ``20000 isp.unknow-error``,
``lookup_unavailable`` a query's ``20000``; ``business_reject`` with the code
``refund_closed`` a refund taken on (``fund_change`` ``N``) and then closed unmade; ``429``
and ``503_before`` are answered as HTTP 429 (with ``Retry-After``) and 503 by the edge in
front of the gateway, unsigned.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any
from urllib.parse import parse_qsl

from outbox import wire
from outbox.kinds import Kind, default_registry
from settled.simulator.injection import Injection
from settled.simulator.messages import Answer, Connection, Request, Response
from settled.simulator.state import Simulator
from settled.simulator.submit import claim_key

PREFIX = "/alipay"
GATEWAY = PREFIX + "/gateway.do"
REFUND = "alipay.trade.refund"
QUERY = "alipay.trade.fastpay.refund.query"
_NODES = {
    REFUND: "alipay_trade_refund_response",
    QUERY: "alipay_trade_fastpay_refund_query_response",
}
_REFUND: Kind = default_registry().get("refund")
_BEIJING = timezone(timedelta(hours=8))
#: the ledger's refusal codes -> Alipay's 40004 sub-codes (any other: the balance)
_REFUSALS = {
    "amount_exceeds_refundable": "ACQ.REFUND_AMT_NOT_EQUAL_TOTAL",
    "order_closed": "ACQ.TRADE_STATUS_ERROR",
    "order_not_found": "ACQ.TRADE_NOT_EXIST",
    "currency_mismatch": "ACQ.INVALID_PARAMETER",
}
_BALANCE = "ACQ.SELLER_BALANCE_NOT_ENOUGH"
#: ``business_reject`` with this code: Alipay takes the refund on (``10000``, ``fund_change``
#: ``N``: no money moved) and then closes it without making it; the query never shows it
TAKEN_ON_THEN_CLOSED = "refund_closed"
_MESSAGES = {
    "20000": "Service Currently Unavailable",
    "40001": "Missing Required Arguments",
    "40002": "Invalid Arguments",
    "40004": "Business Failed",
    "40006": "Insufficient Permissions",
}


def respond(sim: Simulator, request: Request, connection: Connection) -> Response:
    """The Alipay mode's answer to ``request`` (its path starts with ``PREFIX``)."""
    if request.path != GATEWAY or request.method != "POST":
        return Response(404, {}, {})
    form = dict(parse_qsl(request.query, keep_blank_values=True))
    form.update(parse_qsl(request.body.decode("utf-8", "replace"), keep_blank_values=True))
    method = form.get("method", "")
    node = _NODES.get(method, "error_response")
    try:
        tenant = _authenticate(sim, form, node)
        if method not in _NODES:
            raise Answer(_failed(sim, node, "40002", "isv.invalid-method"))
        biz = _biz(sim, form, node)
        if method == REFUND:
            return _refund(sim, tenant, biz, connection)
        return _query(sim, tenant, biz, connection)
    except Answer as answer:
        return answer.response


def _authenticate(sim: Simulator, form: Mapping[str, str], node: str) -> str:
    """The tenant of the request's app, its signature checked; answers 40001 / 40002."""
    for name in ("app_id", "method", "sign", "sign_type", "timestamp", "version", "charset"):
        if not form.get(name):
            raise Answer(_failed(sim, node, "40001", f"isv.missing-{name.replace('_', '-')}"))
    tenant = sim.alipay.tenant_of(form["app_id"])
    if tenant is None:
        raise Answer(_failed(sim, node, "40002", "isv.invalid-app-id"))
    if form["sign_type"] != "RSA2":
        raise Answer(_failed(sim, node, "40002", "isv.invalid-signature-type"))
    content = "&".join(f"{k}={form[k]}" for k in sorted(form) if k != "sign" and form[k])
    if not sim.alipay.verify(form["app_id"], content, form["sign"]):
        raise Answer(_failed(sim, node, "40002", "isv.invalid-signature"))
    try:
        datetime.strptime(form["timestamp"], "%Y-%m-%d %H:%M:%S")
    except ValueError:
        raise Answer(_failed(sim, node, "40002", "isv.invalid-timestamp")) from None
    if form["version"] != "1.0" or form["charset"].lower() != "utf-8":
        raise Answer(_failed(sim, node, "40002", "isv.invalid-parameter"))
    return tenant


def _biz(sim: Simulator, form: Mapping[str, str], node: str) -> dict[str, Any]:
    try:
        biz = json.loads(form.get("biz_content") or "")
    except (ValueError, RecursionError):
        biz = None
    if not isinstance(biz, dict):
        raise Answer(_failed(sim, node, "40002", "isv.invalid-parameter"))
    return biz


def _refund(
    sim: Simulator, tenant: str, biz: Mapping[str, Any], connection: Connection
) -> Response:
    """``alipay.trade.refund``: the ``submit`` steps, answered in Alipay's shape."""
    node = _NODES[REFUND]
    key, order_id = _text(biz.get("out_request_no")), _text(biz.get("out_trade_no"))
    if not key or not order_id or len(key) > 64:
        # Alipay defaults the number for a full refund; Settled always sends one: refuse it.
        raise Answer(_failed(sim, node, "40004", "ACQ.INVALID_PARAMETER"))
    number = sim.count_request("submit", tenant, key, None)
    rule = sim.faults.pick("submit", tenant, _REFUND.name, key, number)
    faults = Injection(sim, rule, connection)
    try:
        faults.before_idempotency()
    except Answer as answer:
        raise Answer(_as_alipay(sim, tenant, order_id, answer.response)) from None
    minor = _fen(biz.get("refund_amount"))
    if minor is None or minor <= 0:
        raise Answer(_failed(sim, node, "40004", "ACQ.REASON_TRADE_REFUND_FEE_ERR"))
    currency = sim.ledger.order_currency(tenant, order_id)
    if currency is None:
        raise Answer(_failed(sim, node, "40004", "ACQ.TRADE_NOT_EXIST"))
    params = {"order_id": order_id, "amount_minor": minor, "currency": currency, "payee": ""}
    fp = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()
    try:
        replay = claim_key(sim, tenant, key, fp)
    except Answer as answer:
        raise Answer(_as_alipay(sim, tenant, order_id, answer.response)) from None
    if replay is not None:
        return faults.on_answer(_as_alipay(sim, tenant, order_id, replay, repeat=True))
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
    return faults.on_answer(_as_alipay(sim, tenant, order_id, execution.response))


def _query(sim: Simulator, tenant: str, biz: Mapping[str, Any], connection: Connection) -> Response:
    """``alipay.trade.fastpay.refund.query``: the refund made with the number, or nothing."""
    node = _NODES[QUERY]
    key, order_id = _text(biz.get("out_request_no")), _text(biz.get("out_trade_no"))
    if not key or not order_id:
        raise Answer(_failed(sim, node, "40004", "ACQ.INVALID_PARAMETER"))
    if not sim.switches.lookup:
        raise Answer(_failed(sim, node, "40006", "isv.insufficient-isv-permissions"))
    number = sim.count_request("lookup", tenant, key, None)
    rule = sim.faults.pick("lookup", tenant, _REFUND.name, key, number)
    try:
        Injection(sim, rule, connection).on_lookup()
    except Answer:
        raise Answer(_failed(sim, node, "20000", "isp.unknow-error")) from None
    if sim.ledger.order_currency(tenant, order_id) is None:
        raise Answer(_failed(sim, node, "40004", "ACQ.TRADE_NOT_EXIST"))
    answer: dict[str, Any] = {
        "code": "10000",
        "msg": "Success",
        "trade_no": trade_no(tenant, order_id),
        "out_trade_no": order_id,
        "out_request_no": key,
    }
    record = sim.ledger.record(tenant, key, not_before=None)
    outcome = record.outcome if record is not None else None
    if (
        record is not None
        and outcome is not None
        and outcome.get("status") == "succeeded"
        and outcome.get("params", {}).get("order_id") == order_id
        and sim.now() - record.created >= sim.switches.lookup_visibility_delay
    ):
        answer["refund_amount"] = _yuan(outcome["params"]["amount_minor"])
        answer["total_amount"] = _yuan(_order_amount(sim, tenant, order_id))
        answer["refund_status"] = "REFUND_SUCCESS"
        answer["gmt_refund_pay"] = _beijing(float(outcome.get("created", sim.now())))
    return signed(sim, node, answer)


def _as_alipay(
    sim: Simulator, tenant: str, order_id: str, response: Response, *, repeat: bool = False
) -> Response:
    """A response of the documented protocol (a saved one too) as Alipay answers a refund;
    ``repeat``: a replay of a saved answer, which moves no money this time."""
    node = _NODES[REFUND]
    headers = dict(response.headers)
    if 200 <= response.status < 300:
        params = response.body.get("params", {})
        answer: dict[str, Any] = {
            "code": "10000",
            "msg": "Success",
            "trade_no": trade_no(tenant, order_id),
            "out_trade_no": params.get("order_id"),
            "buyer_logon_id": "159****5620",
            "fund_change": "N" if repeat else "Y",
            "refund_fee": _yuan(_refunded(sim, tenant, order_id)),
            "gmt_refund_pay": _beijing(float(response.body.get("created", sim.now()))),
        }
        if not repeat:
            answer["send_back_fee"] = _yuan(params.get("amount_minor", 0))
        return signed(sim, node, answer, headers)
    error = response.body.get("error") or {}
    code, kind = str(error.get("code") or ""), error.get("type")
    if response.status == 429:
        return Response(429, {"error": "rate limited"}, headers)
    if response.status == 503 and code == wire.NOT_PROCESSED:
        return Response(503, {"error": "service unavailable"}, headers)
    if response.status >= 500:  # processed, then failed: Alipay's "unknown"
        return _failed(sim, node, "20000", "isp.unknow-error", headers)
    if kind == wire.BUSINESS_ERROR and code == TAKEN_ON_THEN_CLOSED:
        taken_on = {
            "code": "10000",
            "msg": "Success",
            "trade_no": trade_no(tenant, order_id),
            "out_trade_no": order_id,
            "fund_change": "N",
            "refund_fee": _yuan(_refunded(sim, tenant, order_id)),
        }
        return signed(sim, node, taken_on, headers)
    if response.status == 402 or kind == wire.BUSINESS_ERROR:
        return _failed(sim, node, "40004", _REFUSALS.get(code, _BALANCE), headers)
    if kind == wire.IDEMPOTENCY_ERROR:
        if response.status == 409:  # in flight: Alipay's system error, maybe processed
            return _failed(sim, node, "40004", "ACQ.SYSTEM_ERROR", headers)
        return _failed(sim, node, "40004", "ACQ.DISCORDANT_REPEAT_REQUEST", headers)
    if kind == wire.PERMISSION_ERROR:
        return _failed(sim, node, "40006", "isv.insufficient-isv-permissions", headers)
    return _failed(sim, node, "40004", "ACQ.INVALID_PARAMETER", headers)


def signed(
    sim: Simulator, node: str, answer: Mapping[str, Any], headers: Mapping[str, str] | None = None
) -> Response:
    """``answer`` under ``node``, signed over its exact text as the server writes it (the
    HTTP layer writes the body with ``json.dumps``, so the node's text is ``json.dumps`` of it)."""
    body = {node: dict(answer), "sign": sim.alipay.sign(json.dumps(dict(answer)))}
    return Response(200, body, headers or {})


def _failed(
    sim: Simulator,
    node: str,
    code: str,
    sub_code: str,
    headers: Mapping[str, str] | None = None,
) -> Response:
    answer = {"code": code, "msg": _MESSAGES[code], "sub_code": sub_code, "sub_msg": sub_code}
    return signed(sim, node, answer, headers)


def trade_no(tenant: str, order_id: str) -> str:
    """Alipay's trade number of an order (the same for every refund of it)."""
    digits = int(hashlib.sha256(f"{tenant}\x00{order_id}".encode()).hexdigest(), 16)
    return f"2026{digits % 10**24:024d}"


def _refunded(sim: Simulator, tenant: str, order_id: str) -> int:
    """The order's total refunded so far (Alipay's ``refund_fee``)."""
    return int(_order(sim, tenant, order_id).get("refunded_minor", 0))


def _order_amount(sim: Simulator, tenant: str, order_id: str) -> int:
    return int(_order(sim, tenant, order_id).get("amount_minor", 0))


def _order(sim: Simulator, tenant: str, order_id: str) -> Mapping[str, Any]:
    for order in sim.ledger.snapshot().get("orders", []):
        if order.get("tenant") == tenant and order.get("order_id") == order_id:
            return dict(order)
    return {}


def _yuan(minor: object) -> str:
    return f"{Decimal(int(minor) if isinstance(minor, int) else 0).scaleb(-2):.2f}"


def _fen(amount: object) -> int | None:
    text = amount if isinstance(amount, str) else ""
    whole, _, cents = text.partition(".")
    if not whole.isascii() or not whole.isdigit() or len(cents) > 2:
        return None
    if cents and (not cents.isascii() or not cents.isdigit()):
        return None
    return int(whole) * 100 + int((cents or "0").ljust(2, "0"))


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _beijing(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).astimezone(_BEIJING).strftime("%Y-%m-%d %H:%M:%S")
