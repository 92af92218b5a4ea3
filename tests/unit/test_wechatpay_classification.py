"""What each WeChat Pay answer proves: a table of WeChat Pay API v3's documented answers to a
refund's create and query (HTTP status, error ``code``, refund ``status``) served signed by an
in-memory WeChat Pay, each sent through ``WechatPayGateway`` and classified; answers whose
signature does not verify (a body changed on the way, another key, another serial, an old
timestamp, no signature) proving nothing; connection errors by phase; exactly one HTTP request
per send, whatever the answer."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from outbox.downstream import (
    Accepted,
    DownstreamRequest,
    Found,
    LookupMisuse,
    LookupNotFound,
    Misuse,
    NotExecuted,
    NotSent,
    Refused,
    SendPhase,
    Unavailable,
    Unknown,
)
from outbox.kinds import default_registry
from outbox.states import RejectReason
from tests.support.wechatpay import FakeWechatPay, keys, private_pem, rsa_key
from workers.wechatpay_gateway import REFUNDS_PATH, WechatPayGateway

REFUND = default_registry().get("refund")
INTENT = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}
KEY = "stl_key_1"
TOTAL = 100000


def _request(params: dict[str, Any] | None = None) -> DownstreamRequest:
    return DownstreamRequest("acme", "op-9", REFUND, KEY, params or INTENT)


def _refund(**changes: Any) -> dict[str, Any]:
    """A refund as WeChat Pay documents it (申请退款 / 查询单笔退款 answers)."""
    refund: dict[str, Any] = {
        "refund_id": "50000000382019052709732678859",
        "out_refund_no": KEY,
        "transaction_id": "1217752501201407033233368018",
        "out_trade_no": "A1042",
        "channel": "ORIGINAL",
        "user_received_account": "招商银行信用卡0403",
        "success_time": "2026-12-01T16:18:12+08:00",
        "create_time": "2026-12-01T16:18:12+08:00",
        "status": "SUCCESS",
        "funds_account": "AVAILABLE",
        "amount": {
            "total": TOTAL,
            "refund": 10000,
            "payer_total": TOTAL,
            "payer_refund": 10000,
            "settlement_refund": 10000,
            "settlement_total": TOTAL,
            "discount_refund": 0,
            "currency": "CNY",
            "refund_fee": 0,
        },
        "promotion_detail": [],
    }
    refund.update(changes)
    return refund


def _gateway(fake: Callable[[httpx.Request], httpx.Response], **kw: Any) -> WechatPayGateway:
    return WechatPayGateway(
        {"acme": keys()},
        order_totals=kw.pop("order_totals", lambda tenant, order: TOTAL),
        api_base="https://api.mch.weixin.qq.com",
        timeout=5.0,
        transport=httpx.MockTransport(fake),
        **kw,
    )


def _deadline() -> datetime:
    return datetime.now(UTC) + timedelta(seconds=5)


def _answering(status: int, body: Any, **kw: Any) -> FakeWechatPay:
    return FakeWechatPay(lambda request: (status, body), **kw)


def _error(code: str) -> dict[str, str]:
    return {"code": code, "message": "documented example"}


#: (HTTP status, body) -> (outcome, reason, code): every answer WeChat Pay documents for 申请退款
CREATE_ANSWERS: list[tuple[str, int, Any, type, RejectReason | None, str | None]] = [
    ("SUCCESS", 200, _refund(), Accepted, None, None),
    ("PROCESSING", 200, _refund(status="PROCESSING"), Unknown, None, None),
    (
        "CLOSED",
        200,
        _refund(status="CLOSED"),
        Refused,
        RejectReason.BUSINESS_REJECTED,
        "refund_closed",
    ),
    (
        "ABNORMAL",
        200,
        _refund(status="ABNORMAL"),
        Refused,
        RejectReason.BUSINESS_REJECTED,
        "refund_abnormal",
    ),
    ("undocumented status", 200, _refund(status="REFUNDING"), Unknown, None, None),
    (
        "PARAM_ERROR",
        400,
        _error("PARAM_ERROR"),
        Refused,
        RejectReason.INVALID_PARAMS,
        "PARAM_ERROR",
    ),
    (
        "INVALID_REQUEST",
        400,
        _error("INVALID_REQUEST"),
        Refused,
        RejectReason.INVALID_PARAMS,
        "INVALID_REQUEST",
    ),
    (
        "APPID_MCHID_NOT_MATCH",
        400,
        _error("APPID_MCHID_NOT_MATCH"),
        Refused,
        RejectReason.INVALID_PARAMS,
        "APPID_MCHID_NOT_MATCH",
    ),
    (
        "RESOURCE_NOT_EXISTS",
        404,
        _error("RESOURCE_NOT_EXISTS"),
        Refused,
        RejectReason.INVALID_PARAMS,
        "RESOURCE_NOT_EXISTS",
    ),
    (
        "SIGN_ERROR",
        401,
        _error("SIGN_ERROR"),
        Refused,
        RejectReason.PERMISSION_DENIED,
        "SIGN_ERROR",
    ),
    ("NO_AUTH", 403, _error("NO_AUTH"), Refused, RejectReason.PERMISSION_DENIED, "NO_AUTH"),
    (
        "MCH_NOT_EXISTS",
        400,
        _error("MCH_NOT_EXISTS"),
        Refused,
        RejectReason.PERMISSION_DENIED,
        "MCH_NOT_EXISTS",
    ),
    (
        "NOT_ENOUGH",
        403,
        _error("NOT_ENOUGH"),
        Refused,
        RejectReason.BUSINESS_REJECTED,
        "NOT_ENOUGH",
    ),
    (
        "USER_ACCOUNT_ABNORMAL",
        403,
        _error("USER_ACCOUNT_ABNORMAL"),
        Refused,
        RejectReason.BUSINESS_REJECTED,
        "USER_ACCOUNT_ABNORMAL",
    ),
    ("FREQUENCY_LIMITED", 429, _error("FREQUENCY_LIMITED"), NotExecuted, None, None),
    ("SYSTEM_ERROR", 500, _error("SYSTEM_ERROR"), Unknown, None, None),
    ("502 without a body", 502, {}, Unknown, None, None),
    ("undocumented 400", 400, _error("SOMETHING_NEW"), Misuse, None, None),
]


@pytest.mark.parametrize(
    ("status", "body", "outcome", "reason", "code"),
    [row[1:] for row in CREATE_ANSWERS],
    ids=[row[0] for row in CREATE_ANSWERS],
)
def test_each_documented_create_answer_is_classified_by_what_it_proves(
    status: int, body: Any, outcome: type, reason: RejectReason | None, code: str | None
) -> None:
    fake = _answering(status, body)
    with _gateway(fake) as gateway:
        got = gateway.submit(_request(), deadline=_deadline())
    assert type(got) is outcome, got
    if reason is not None:
        assert isinstance(got, Refused) and (got.reason, got.code) == (reason, code), got
    assert len(fake.requests) == 1  # one HTTP request per send, whatever the answer


def test_the_create_carries_the_key_as_out_refund_no_and_the_amounts_in_fen() -> None:
    fake = _answering(200, _refund())
    with _gateway(fake) as gateway:
        got = gateway.submit(_request(), deadline=_deadline())
    assert isinstance(got, Accepted), got
    (sent,) = fake.requests
    assert (sent.method, sent.url.path) == ("POST", REFUNDS_PATH)
    assert json.loads(sent.content) == {
        "out_trade_no": "A1042",
        "out_refund_no": KEY,
        "amount": {"refund": 10000, "total": TOTAL, "currency": "CNY"},
    }
    assert sent.headers["Authorization"].startswith('WECHATPAY2-SHA256-RSA2048 mchid="1900000109"')
    assert got.receipt.reference == "50000000382019052709732678859"
    assert dict(got.receipt.params) == INTENT


def test_a_rate_limit_honours_a_retry_after_where_one_is_sent() -> None:
    fake = FakeWechatPay(
        lambda request: (429, _error("FREQUENCY_LIMITED")),
        tamper=None,
    )
    with _gateway(fake) as gateway:
        plain = gateway.submit(_request(), deadline=_deadline())
    assert plain == NotExecuted(429, None)

    def with_retry_after(headers: dict[str, str], raw: bytes) -> tuple[dict[str, str], bytes]:
        return {**headers, "Retry-After": "7"}, raw  # outside what is signed

    fake = _answering(429, _error("FREQUENCY_LIMITED"), tamper=with_retry_after)
    with _gateway(fake) as gateway:
        assert gateway.submit(_request(), deadline=_deadline()) == NotExecuted(429, 7.0)


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("amount", {**_refund()["amount"], "refund": 10001}, "receipt_mismatch"),
        ("amount", {**_refund()["amount"], "currency": "USD"}, "receipt_mismatch"),
        ("out_trade_no", "A9999", "receipt_mismatch"),
        ("out_refund_no", "stl_someone_else", "receipt_key_mismatch"),
        ("refund_id", "re<script>", "receipt_unreadable"),
    ],
)
def test_a_refund_that_does_not_fit_the_intent_is_misuse(field: str, value: Any, code: str) -> None:
    fake = _answering(200, _refund(**{field: value}))
    with _gateway(fake) as gateway:
        got = gateway.submit(_request(), deadline=_deadline())
    assert isinstance(got, Misuse) and got.code == code, got


#: (HTTP status, body) -> lookup outcome: 查询单笔退款's documented answers
LOOKUP_ANSWERS: list[tuple[str, int, Any, type, RejectReason | None]] = [
    ("SUCCESS", 200, _refund(), Found, None),
    ("CLOSED", 200, _refund(status="CLOSED"), Found, RejectReason.BUSINESS_REJECTED),
    ("ABNORMAL", 200, _refund(status="ABNORMAL"), Found, RejectReason.BUSINESS_REJECTED),
    ("PROCESSING", 200, _refund(status="PROCESSING"), Unavailable, None),
    ("RESOURCE_NOT_EXISTS", 404, _error("RESOURCE_NOT_EXISTS"), LookupNotFound, None),
    ("a bare 404", 404, {}, Unavailable, None),
    ("SYSTEM_ERROR", 500, _error("SYSTEM_ERROR"), Unavailable, None),
    ("FREQUENCY_LIMITED", 429, _error("FREQUENCY_LIMITED"), Unavailable, None),
    ("SIGN_ERROR", 401, _error("SIGN_ERROR"), Unavailable, None),
    ("PARAM_ERROR", 400, _error("PARAM_ERROR"), Unavailable, None),
    (
        "another amount",
        200,
        _refund(amount={**_refund()["amount"], "refund": 1}),
        LookupMisuse,
        None,
    ),
]


@pytest.mark.parametrize(
    ("status", "body", "outcome", "reason"),
    [row[1:] for row in LOOKUP_ANSWERS],
    ids=[row[0] for row in LOOKUP_ANSWERS],
)
def test_each_documented_query_answer_is_classified_by_what_it_proves(
    status: int, body: Any, outcome: type, reason: RejectReason | None
) -> None:
    fake = _answering(status, body)
    with _gateway(fake) as gateway:
        got = gateway.lookup(_request(), deadline=_deadline())
    assert type(got) is outcome, got
    if isinstance(got, Found):
        assert got.reason is reason, got
        assert got.receipt.status == ("succeeded" if reason is None else "rejected")
    if isinstance(got, Unavailable):
        assert got.pending is (body.get("status") == "PROCESSING"), got
    if isinstance(got, LookupMisuse):
        assert got.code == "receipt_mismatch" and got.record is not None
    (sent,) = fake.requests  # a query, never a second create
    assert (sent.method, sent.url.path) == ("GET", f"{REFUNDS_PATH}/{KEY}")
    assert sent.content == b""


def _changed_body(headers: dict[str, str], raw: bytes) -> tuple[dict[str, str], bytes]:
    changed = raw.replace(b"SUCCESS", b"CLOSED").replace(b"documented example", b"changed")
    assert changed != raw
    return headers, changed


def _forged_refusal(headers: dict[str, str], raw: bytes) -> tuple[dict[str, str], bytes]:
    return headers, json.dumps(_error("USER_ACCOUNT_ABNORMAL")).encode()


def _no_signature(headers: dict[str, str], raw: bytes) -> tuple[dict[str, str], bytes]:
    return {k: v for k, v in headers.items() if k != "Wechatpay-Signature"}, raw


def _other_serial(headers: dict[str, str], raw: bytes) -> tuple[dict[str, str], bytes]:
    return {**headers, "Wechatpay-Serial": "PUB_KEY_ID_SOMEONE_ELSE"}, raw


def _signature_garbage(headers: dict[str, str], raw: bytes) -> tuple[dict[str, str], bytes]:
    return {**headers, "Wechatpay-Signature": "not base64 at all!"}, raw


TAMPERED: list[tuple[str, dict[str, Any]]] = [
    ("body changed after signing", {"tamper": _changed_body}),
    ("a refusal put in place of the signed answer", {"tamper": _forged_refusal}),
    ("no signature", {"tamper": _no_signature}),
    ("another serial", {"tamper": _other_serial}),
    ("a signature that is not base64", {"tamper": _signature_garbage}),
    ("signed by another key", {"signer": rsa_key("impostor")}),
    ("an answer signed ten minutes ago", {"clock": lambda: datetime.now(UTC).timestamp() - 600}),
]


@pytest.mark.parametrize("status", [200, 403])
@pytest.mark.parametrize("change", [t[1] for t in TAMPERED], ids=[t[0] for t in TAMPERED])
def test_an_answer_whose_signature_does_not_verify_proves_nothing(
    change: dict[str, Any], status: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A success or a refusal alike: neither may settle the operation, and the request may
    have been carried out (unknown: looked up, never taken as done or not done)."""
    body = _refund() if status == 200 else _error("NOT_ENOUGH")
    fake = _answering(status, body, **change)
    with _gateway(fake) as gateway, caplog.at_level(logging.INFO):
        sent = gateway.submit(_request(), deadline=_deadline())
        looked = gateway.lookup(_request(), deadline=_deadline())
    assert isinstance(sent, Unknown) and "signature" in sent.detail, sent
    assert isinstance(looked, Unavailable) and not looked.pending, looked
    assert len(fake.requests) == 2
    assert "its signature does not verify" in caplog.text


def test_the_untampered_answer_of_the_same_fake_verifies() -> None:
    """The tampering above is what is refused: the same answers, as signed, are read."""
    for status, body, outcome in [(200, _refund(), Accepted), (403, _error("NOT_ENOUGH"), Refused)]:
        with _gateway(_answering(status, body)) as gateway:
            assert type(gateway.submit(_request(), deadline=_deadline())) is outcome


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (httpx.ConnectError("refused"), NotSent),
        (httpx.ConnectTimeout("slow connect"), NotSent),
        (httpx.PoolTimeout("no connection"), NotSent),
        (httpx.ReadTimeout("no answer"), Unknown),
        (httpx.WriteError("broken pipe"), Unknown),
        (httpx.RemoteProtocolError("reset"), Unknown),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else value.__name__,
)
def test_connection_errors_are_split_by_phase_and_sent_once(
    error: httpx.TransportError, outcome: type
) -> None:
    calls: list[httpx.Request] = []

    def fail(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise error

    with _gateway(fail) as gateway:
        got = gateway.submit(_request(), deadline=_deadline())
        looked = gateway.lookup(_request(), deadline=_deadline())
    assert type(got) is outcome, got
    assert isinstance(looked, Unavailable)
    assert len(calls) == 2  # one each: nothing retried


def _never(request: httpx.Request) -> httpx.Response:
    raise AssertionError("nothing may be sent")


def test_what_cannot_be_sent_is_decided_locally_and_nothing_is_sent() -> None:
    with _gateway(_never) as gateway:
        usd = gateway.submit(_request({**INTENT, "currency": "USD"}), deadline=_deadline())
        late = gateway.submit(_request(), deadline=datetime.now(UTC) - timedelta(seconds=1))
        stranger = gateway.submit(
            DownstreamRequest("globex", "op-1", REFUND, KEY, INTENT), deadline=_deadline()
        )
    assert usd == Refused(RejectReason.INVALID_PARAMS, "currency_not_cny", 0)
    assert isinstance(late, NotSent) and late.phase is SendPhase.BEFORE
    assert stranger == Refused(RejectReason.PERMISSION_DENIED, "no_merchant_key", 0)
    with _gateway(_never, order_totals=lambda tenant, order: None) as gateway:
        unknown_total = gateway.submit(_request(), deadline=_deadline())
    assert unknown_total == Refused(RejectReason.INVALID_PARAMS, "order_total_unknown", 0)

    def broken(tenant: str, order: str) -> int:
        raise ConnectionError("the app's database is down")

    with _gateway(_never, order_totals=broken) as gateway:
        unread = gateway.submit(_request(), deadline=_deadline())
    assert isinstance(unread, NotSent) and unread.phase is SendPhase.BEFORE


def test_the_merchant_key_is_in_no_repr_log_or_outcome(caplog: pytest.LogCaptureFixture) -> None:
    pem = private_pem(rsa_key("merchant"))
    secret = pem.splitlines()[5]  # a line of the key itself
    from tests.support.wechatpay import merchant

    settings = merchant()
    fake = _answering(200, _refund())
    with _gateway(fake) as gateway, caplog.at_level(logging.DEBUG):
        outcome = gateway.submit(_request(), deadline=_deadline())
        looked = gateway.lookup(_request(), deadline=_deadline())
        seen = " ".join([repr(settings), repr(keys()), repr(gateway), repr(outcome), repr(looked)])
    assert secret not in seen and secret not in caplog.text
    assert "SecretStr('**********')" in repr(settings)
