"""The simulator's WeChat Pay mode: the part of WeChat Pay API v3 the WeChat Pay gateway uses,
under ``/wechatpay`` (the gateway's API base is the simulator's URL + ``/wechatpay``), written
from WeChat Pay's public documentation of refunds (申请退款, 查询单笔退款) and of its signatures.

- ``POST /wechatpay/v3/refund/domestic/refunds``: JSON ``out_trade_no``, ``out_refund_no``,
  ``amount`` ``{refund, total, currency}``; answers the refund, or WeChat Pay's error JSON
  (``{"code", "message"}``);
- ``GET /wechatpay/v3/refund/domestic/refunds/{out_refund_no}``: the refund with that number,
  or 404 ``RESOURCE_NOT_EXISTS``.

Every request must carry a ``WECHATPAY2-SHA256-RSA2048`` ``Authorization`` whose signature
verifies with the public key its merchant registered (``POST /_control/wechatpay/merchants``),
made less than five minutes ago (else 401 ``SIGN_ERROR``); every answer is signed with the
platform key this mode makes when it is first used (``Wechatpay-Timestamp``, ``-Nonce``,
``-Signature``, ``-Serial``), its public key and id answered by that registration.

A refund goes through the same steps, fault rules and ledger as a submit of the documented
protocol (``submit``): ``out_trade_no`` is the order, ``amount.refund`` the refund's amount,
``amount.total`` must be the order's amount, the currency CNY. WeChat Pay makes one refund per
``out_refund_no``: a request repeating a number answers that number's refund, whatever else it
says (``claim``). The faults answer in WeChat Pay's shape: ``429`` as ``FREQUENCY_LIMITED``
(with the rule's ``Retry-After``), ``403`` as ``NO_AUTH``, ``503_before`` / ``503_after_commit``
/ ``lookup_unavailable`` as ``SYSTEM_ERROR``, ``business_reject`` by its code
(``NOT_ENOUGH``, ``USER_ACCOUNT_ABNORMAL``; ``refund_closed`` and ``refund_abnormal`` make a
``CLOSED`` or ``ABNORMAL`` refund; any other code ``NOT_ENOUGH``).

``PROCESSING``: ``POST /_control/wechatpay/processing`` (``wechatpay_control``) makes the next
create of a key take the refund on without making it (answered and queried ``PROCESSING``,
nothing in the ledger), and ``POST /_control/wechatpay/settle`` ends it as WeChat Pay would:
``SUCCESS`` (executed in the ledger then), ``CLOSED`` or ``ABNORMAL`` (kept as refused, no
effect).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from outbox import wire
from outbox.kinds import Kind, default_registry
from settled.simulator.injection import Injection
from settled.simulator.ledger import Scripted
from settled.simulator.messages import Answer, Connection, Request, Response, parse_json
from settled.simulator.state import Simulator
from settled.simulator.wechatpay_signatures import (
    MAX_SKEW_SECONDS,
    SCHEMA,
    answer_text,
    authorization_fields,
    request_text,
    sign,
    verified,
)

PREFIX = "/wechatpay"
REFUNDS = PREFIX + "/v3/refund/domestic/refunds"
REFUND: Kind = default_registry().get("refund")
_NUMBER = re.compile(r"^[0-9A-Za-z_\-|*@]{1,64}$")
_CHINA = timezone(timedelta(hours=8))
#: the ledger's refusal codes -> (HTTP status, WeChat Pay's code, its message)
_REFUSALS = {
    "amount_exceeds_refundable": (400, "INVALID_REQUEST", "申请退款金额超过订单可退金额"),
    "order_closed": (400, "INVALID_REQUEST", "订单已全额退款"),
    "order_not_found": (404, "RESOURCE_NOT_EXISTS", "订单号不存在"),
    "currency_mismatch": (400, "PARAM_ERROR", "币种与原订单不一致"),
    "NOT_ENOUGH": (403, "NOT_ENOUGH", "余额不足"),
    "USER_ACCOUNT_ABNORMAL": (403, "USER_ACCOUNT_ABNORMAL", "用户账户异常"),
}
#: refusal codes kept as a refund WeChat Pay made and ended unpaid: code -> refund status
_ENDED = {"refund_closed": "CLOSED", "refund_abnormal": "ABNORMAL"}
FINAL_STATUSES = ("SUCCESS", "CLOSED", "ABNORMAL")


@dataclass(frozen=True)
class Merchant:
    """A merchant registered with this mode: its tenant, certificate serial, public key, and
    its APIv3 key (what its notifications are encrypted with; None: it takes none)."""

    tenant: str
    mchid: str
    serial_no: str
    public_key: rsa.RSAPublicKey = field(repr=False)
    api_v3_key: bytes | None = field(default=None, repr=False)


@dataclass
class Pending:
    """A refund taken on and not made yet (``PROCESSING``)."""

    params: dict[str, Any]
    fingerprint: str
    refund_id: str
    created: float


class WechatPayMode:
    """This mode's state beside the simulator's: the platform key (made once, at first use),
    the merchants, the refunds ``PROCESSING`` and the creates scripted to be."""

    def __init__(self) -> None:
        self.platform_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.platform_serial = "PUB_KEY_ID_" + secrets.token_hex(12).upper()
        self.merchants: dict[str, Merchant] = {}
        self.pending: dict[tuple[str, str], Pending] = {}
        #: (tenant, key pattern, times left) of the creates to take on as PROCESSING
        self.processing: list[list[Any]] = []
        self.lock = threading.Lock()

    def platform_public_pem(self) -> str:
        return (
            self.platform_key.public_key()
            .public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            .decode()
        )

    def take_processing(self, tenant: str, key: str) -> bool:
        """Whether this create is scripted to be taken on as ``PROCESSING`` (uses it once)."""
        with self.lock:
            for scripted in self.processing:
                if scripted[0] == tenant and fnmatch.fnmatchcase(key, scripted[1]):
                    scripted[2] -= 1
                    if scripted[2] <= 0:
                        self.processing.remove(scripted)
                    return True
        return False


def respond(
    mode: WechatPayMode, sim: Simulator, request: Request, connection: Connection
) -> Response:
    """This mode's answer to ``request`` (its path starts with ``PREFIX``), signed."""
    try:
        if request.path == REFUNDS and request.method == "POST":
            answer = create_refund(mode, sim, request, connection)
        elif request.path.startswith(REFUNDS + "/") and request.method == "GET":
            answer = query_refund(mode, sim, request, connection)
        else:
            answer = wechat_error(404, "RESOURCE_NOT_EXISTS", "no such route")
    except Answer as early:
        answer = as_wechat(early.response)
    return signed(mode, answer, sim.now())


def signed(mode: WechatPayMode, response: Response, now: float) -> Response:
    """``response`` with the platform's signature over its body (the bytes the HTTP layer
    writes: ``json.dumps`` of the body, as ``httpserver`` writes it), signed at ``now``: the
    simulator's clock, which a test may set off (as the answer's ``Date``), so a WeChat Pay
    whose clock runs behind signs its answers with its own time. (Set off by more than
    ``MAX_SKEW_SECONDS``, its answers are refused as stale, as WeChat Pay's would be.)"""
    body = json.dumps(response.body).encode()
    stamp, nonce = str(int(now)), secrets.token_hex(16)
    signature = {
        "Wechatpay-Timestamp": stamp,
        "Wechatpay-Nonce": nonce,
        "Wechatpay-Signature": sign(mode.platform_key, answer_text(stamp, nonce, body)),
        "Wechatpay-Serial": mode.platform_serial,
        "Wechatpay-Signature-Type": SCHEMA,
    }
    request_id = {"Request-ID": secrets.token_hex(16)}
    return Response(response.status, response.body, {**response.headers, **signature, **request_id})


def authenticate(mode: WechatPayMode, request: Request) -> str:
    """The tenant whose merchant signed ``request``; answers 401 ``SIGN_ERROR`` otherwise."""
    fields = authorization_fields(request.fields.get("authorization") or "")
    merchant = mode.merchants.get(fields["mchid"]) if fields else None
    if fields is None or merchant is None or fields["serial_no"] != merchant.serial_no:
        raise Answer(wechat_error(401, "SIGN_ERROR", "签名错误"))
    stamp = fields["timestamp"]
    if (
        not stamp.isascii()
        or not stamp.isdigit()
        or abs(int(stamp) - time.time()) > MAX_SKEW_SECONDS
    ):
        raise Answer(wechat_error(401, "SIGN_ERROR", "签名错误: timestamp"))
    url = request.path + (f"?{request.query}" if request.query else "")
    signed_text = request_text(request.method, url, stamp, fields["nonce_str"], request.body)
    if not verified(merchant.public_key, signed_text, fields["signature"]):
        raise Answer(wechat_error(401, "SIGN_ERROR", "签名错误"))
    return merchant.tenant


def create_refund(
    mode: WechatPayMode, sim: Simulator, request: Request, connection: Connection
) -> Response:
    """``POST /v3/refund/domestic/refunds``: the ``submit`` steps, in WeChat Pay's format."""
    tenant = authenticate(mode, request)
    try:
        body = parse_json(request.body)
    except ValueError:
        raise Answer(wechat_error(400, "PARAM_ERROR", "请求体不是 JSON")) from None
    key = body.get("out_refund_no") if isinstance(body, dict) else None
    if not isinstance(key, str) or not _NUMBER.fullmatch(key):
        raise Answer(wechat_error(400, "PARAM_ERROR", "out_refund_no 格式错误"))
    number = sim.count_request("submit", tenant, key, None)
    faults = Injection(sim, sim.faults.pick("submit", tenant, REFUND.name, key, number), connection)
    faults.before_idempotency()
    params = _intent(sim, tenant, body)
    fp = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()
    replay = claim(mode, sim, tenant, key, fp)
    if replay is not None:
        saved, outcome = replay
        return as_wechat(faults.on_answer(saved), outcome)
    if mode.take_processing(tenant, key):
        sim.ledger.forget(tenant, key)  # nothing executed: no record yet
        taken = Pending(params, fp, "re_" + secrets.token_hex(8), sim.now())
        with mode.lock:
            mode.pending[(tenant, key)] = taken
        return _pending_refund(key, taken)
    faults.before_commit()
    with faults.in_execution(REFUND) as scripted:
        execution = sim.ledger.execute(
            tenant=tenant,
            kind=REFUND.name,
            key=key,
            fingerprint=fp,
            params=params,
            now=sim.now(),
            scripted=_wechat_code(scripted),
        )
    return as_wechat(faults.on_answer(execution.response), execution.outcome)


def claim(
    mode: WechatPayMode, sim: Simulator, tenant: str, key: str, fp: str
) -> tuple[Response, Mapping[str, Any] | None] | None:
    """The answer already given for ``key`` and its outcome (its refund, whatever this request
    says), or None to execute (the key then marked in flight). A key in flight answers
    ``SYSTEM_ERROR``: the first request may still make the refund."""
    with mode.lock:
        pending = mode.pending.get((tenant, key))
    if pending is not None:
        return _pending_refund(key, pending), None
    with sim.idempotency_lock:
        record = sim.ledger.record(tenant, key, not_before=sim.retention_floor())
        if record is None:
            sim.ledger.begin(tenant, key, fp, sim.now())
            return None
        if record.state == "in_flight":
            raise Answer(wechat_error(500, "SYSTEM_ERROR", "系统繁忙，请稍后重试"))
    if record.response is None:
        return None
    return record.response, record.outcome


def query_refund(
    mode: WechatPayMode, sim: Simulator, request: Request, connection: Connection
) -> Response:
    """``GET /v3/refund/domestic/refunds/{out_refund_no}``: the refund with that number."""
    tenant = authenticate(mode, request)
    key = request.path[len(REFUNDS) + 1 :]
    number = sim.count_request("lookup", tenant, key, None)
    Injection(
        sim, sim.faults.pick("lookup", tenant, REFUND.name, key, number), connection
    ).on_lookup()
    with mode.lock:
        pending = mode.pending.get((tenant, key))
    if pending is not None:
        return _pending_refund(key, pending)
    record = sim.ledger.record(tenant, key, not_before=sim.retention_floor())
    missing = wechat_error(404, "RESOURCE_NOT_EXISTS", "退款单不存在")
    if record is None or record.outcome is None:
        return missing
    if sim.now() - record.created < sim.switches.lookup_visibility_delay:
        return missing
    outcome = record.outcome
    if outcome.get("status") == "succeeded":
        return Response(200, refund_object(outcome, "SUCCESS"), {})
    code = str((outcome.get("error") or {}).get("code") or "")
    if code in _ENDED:
        return Response(200, refund_object(outcome, _ENDED[code]), {})
    return missing  # a refused create made no refund


def _intent(sim: Simulator, tenant: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The refund intent the body asks for; answers WeChat Pay's 400 or 404."""
    order = body.get("out_trade_no")
    amount = body.get("amount")
    if not isinstance(order, str) or not order or not isinstance(amount, dict):
        raise Answer(wechat_error(400, "PARAM_ERROR", "缺少参数 out_trade_no 或 amount"))
    refund, total, currency = amount.get("refund"), amount.get("total"), amount.get("currency")
    for value in (refund, total):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise Answer(wechat_error(400, "PARAM_ERROR", "amount 金额必须为正整数"))
    if currency != "CNY":
        raise Answer(wechat_error(400, "PARAM_ERROR", "amount.currency 必须为 CNY"))
    charged = sim.ledger.order_amount(tenant, order)
    if charged is None:
        raise Answer(wechat_error(404, "RESOURCE_NOT_EXISTS", "订单号不存在"))
    if total != charged:
        raise Answer(wechat_error(400, "PARAM_ERROR", "订单金额与原订单金额不一致"))
    return {
        "order_id": order,
        "amount_minor": refund,
        "currency": currency,
        "payee": "",
        "total": total,
    }


def _wechat_code(scripted: Scripted) -> Scripted:
    """A scripted business refusal with a code WeChat Pay answers (``NOT_ENOUGH`` unless it
    names one of its own)."""
    code = scripted.refusal_code
    if code is None or code in _REFUSALS or code in _ENDED:
        return scripted
    return Scripted("NOT_ENOUGH", scripted.wrong_field, scripted.answer_503)


def refund_object(outcome: Mapping[str, Any], status: str) -> dict[str, Any]:
    """WeChat Pay's refund for a saved outcome of the ledger."""
    params = outcome.get("params", {})
    created = datetime.fromtimestamp(float(outcome.get("created", 0)), UTC).astimezone(_CHINA)
    refund, total = params.get("amount_minor"), params.get("total")
    answer: dict[str, Any] = {
        "refund_id": outcome["id"],
        "out_refund_no": outcome.get("idempotency_key"),
        "transaction_id": "4200"
        + hashlib.sha256(str(params.get("order_id")).encode()).hexdigest()[:24],
        "out_trade_no": params.get("order_id"),
        "channel": "ORIGINAL",
        "user_received_account": "支付用户零钱",
        "create_time": created.isoformat(timespec="seconds"),
        "status": status,
        "funds_account": "AVAILABLE",
        "amount": {
            "total": total,
            "refund": refund,
            "payer_total": total,
            "payer_refund": refund,
            "settlement_total": total,
            "settlement_refund": refund,
            "discount_refund": 0,
            "currency": params.get("currency", "CNY"),
            "refund_fee": 0,
        },
        "promotion_detail": [],
    }
    if status == "SUCCESS":
        answer["success_time"] = answer["create_time"]
    return answer


def _pending_refund(key: str, pending: Pending) -> Response:
    outcome = {
        "id": pending.refund_id,
        "idempotency_key": key,
        "params": pending.params,
        "created": pending.created,
    }
    return Response(200, refund_object(outcome, "PROCESSING"), {})


def as_wechat(response: Response, outcome: Mapping[str, Any] | None = None) -> Response:
    """A response of the documented protocol (a saved one too) in WeChat Pay's format;
    ``outcome``: the ledger's record of the execution it answers, where there is one."""
    headers = dict(response.headers)
    body = response.body
    if "refund_id" in body or ("code" in body and "error" not in body):  # WeChat Pay's already
        return response
    if 200 <= response.status < 300:
        return Response(response.status, refund_object(body, "SUCCESS"), headers)
    error = body.get("error") or {}
    code, kind = str(error.get("code") or ""), error.get("type")
    if response.status == 402 or kind == wire.BUSINESS_ERROR:
        if code in _ENDED and outcome is not None:  # made and ended unpaid: the refund
            return Response(200, refund_object(outcome, _ENDED[code]), headers)
        status, wechat_code, text = _REFUSALS.get(code, _REFUSALS["NOT_ENOUGH"])
        return wechat_error(status, wechat_code, text, headers)
    if response.status == 429:
        return wechat_error(429, "FREQUENCY_LIMITED", "频率限制", headers)
    if kind == wire.PERMISSION_ERROR:
        return wechat_error(403, "NO_AUTH", "没有退款权限", headers)
    if response.status == 401:
        return wechat_error(401, "SIGN_ERROR", "签名错误", headers)
    if response.status >= 500:
        return wechat_error(500, "SYSTEM_ERROR", "系统超时", headers)
    if response.status == 404:
        return wechat_error(404, "RESOURCE_NOT_EXISTS", "资源不存在", headers)
    return wechat_error(400, "PARAM_ERROR", code or "参数错误", headers)


def wechat_error(
    status: int, code: str, text: str, headers: Mapping[str, str] | None = None
) -> Response:
    """An error answer in WeChat Pay's shape."""
    return Response(status, {"code": code, "message": text}, headers or {})
