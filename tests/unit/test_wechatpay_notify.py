"""WeChat Pay's refund-result notification, read (``workers.wechatpay_notify``): taken only
once its signature verifies with the platform key, it is fresh, its resource decrypts with the
merchant's APIv3 key and it is this merchant's; then read as a query's answer would be."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from outbox.downstream import Found, LookupMisuse
from outbox.states import RejectReason
from settled.simulator.wechatpay_signatures import SCHEMA, answer_text, sign
from tests.support.wechatpay import API_V3_KEY, MCHID, PLATFORM_SERIAL, keys, rsa_key
from workers.wechatpay_notify import NotificationRefused, decrypt, read_notification

KEY = "k_3f2a9c"
PARAMS = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}
NOW = time.time()


def resource(**changes: Any) -> dict[str, Any]:
    """The decrypted refund of a notification, as WeChat Pay documents it."""
    refund: dict[str, Any] = {
        "mchid": MCHID,
        "out_trade_no": "A1042",
        "transaction_id": "4200000000000000000000000001",
        "out_refund_no": KEY,
        "refund_id": "50000000382019052709732678859",
        "refund_status": "SUCCESS",
        "success_time": "2026-12-03T15:12:05+08:00",
        "user_received_account": "支付用户零钱",
        "amount": {"total": 10000, "refund": 10000, "payer_total": 10000, "payer_refund": 10000},
    }
    refund.update(changes)
    return refund


def notification(
    refund: dict[str, Any] | None = None,
    *,
    event_type: str = "REFUND.SUCCESS",
    api_v3_key: str = API_V3_KEY,
    timestamp: float = NOW,
    seal: bytes | None = None,
    algorithm: str = "AEAD_AES_256_GCM",
) -> tuple[dict[str, str], bytes]:
    """A notification's headers and body, encrypted and signed as WeChat Pay does."""
    nonce, associated = "fdasflkja484", "refund"
    plain = json.dumps(refund or resource(), ensure_ascii=False).encode()
    sealed = seal or AESGCM(api_v3_key.encode()).encrypt(nonce.encode(), plain, associated.encode())
    body = json.dumps(
        {
            "id": "EV-2018022511223320873",
            "create_time": "2026-12-03T15:12:06+08:00",
            "resource_type": "encrypt-resource",
            "event_type": event_type,
            "summary": "退款成功",
            "resource": {
                "original_type": "refund",
                "algorithm": algorithm,
                "ciphertext": base64.b64encode(sealed).decode(),
                "associated_data": associated,
                "nonce": nonce,
            },
        }
    ).encode()
    stamp, sign_nonce = str(int(timestamp)), "n-1"
    headers = {
        "Wechatpay-Timestamp": stamp,
        "Wechatpay-Nonce": sign_nonce,
        "Wechatpay-Signature": sign(rsa_key("platform"), answer_text(stamp, sign_nonce, body)),
        "Wechatpay-Serial": PLATFORM_SERIAL,
        "Wechatpay-Signature-Type": SCHEMA,
    }
    return headers, body


def read(headers: dict[str, str], body: bytes, **kw: Any) -> Any:
    return read_notification(keys(), API_V3_KEY.encode(), headers, body, now=kw.get("now", NOW))


def refused(headers: dict[str, str], body: bytes, **kw: Any) -> NotificationRefused:
    with pytest.raises(NotificationRefused) as caught:
        read(headers, body, **kw)
    return caught.value


@pytest.mark.parametrize(
    ("status", "event_type", "reason", "code"),
    [
        ("SUCCESS", "REFUND.SUCCESS", None, None),
        ("CLOSED", "REFUND.CLOSED", RejectReason.BUSINESS_REJECTED, "refund_closed"),
        ("ABNORMAL", "REFUND.ABNORMAL", RejectReason.BUSINESS_REJECTED, "refund_abnormal"),
    ],
)
def test_a_verified_notification_proves_what_a_query_would(
    status: str, event_type: str, reason: RejectReason | None, code: str | None
) -> None:
    notice = read(*notification(resource(refund_status=status), event_type=event_type))
    assert notice.out_refund_no == KEY and notice.id == "EV-2018022511223320873"
    found = notice.as_lookup(PARAMS)
    assert isinstance(found, Found)
    assert (found.reason, found.code) == (reason, code)
    assert found.receipt.reference == "50000000382019052709732678859"
    assert found.receipt.status == ("succeeded" if status == "SUCCESS" else "rejected")


def test_a_notified_refund_of_another_amount_is_a_mismatch_not_a_settlement() -> None:
    amount = {"total": 10000, "refund": 5000, "payer_total": 10000, "payer_refund": 5000}
    lookup = read(*notification(resource(amount=amount))).as_lookup(PARAMS)
    assert isinstance(lookup, LookupMisuse) and lookup.code == "receipt_mismatch"
    assert lookup.record is not None  # what WeChat Pay did, kept for review


def test_a_tampered_body_is_refused_by_its_signature() -> None:
    headers, body = notification()
    refusal = refused(headers, body.replace(b"REFUND.SUCCESS", b"REFUND.CLOSED"))
    assert (refusal.code, refusal.status) == ("unverified", 401)


def test_a_tampered_signature_is_refused() -> None:
    headers, body = notification()
    raw = bytearray(base64.b64decode(headers["Wechatpay-Signature"]))
    raw[7] ^= 1
    headers["Wechatpay-Signature"] = base64.b64encode(bytes(raw)).decode()
    assert refused(headers, body).code == "unverified"


def test_a_notification_signed_by_another_key_is_refused() -> None:
    headers, body = notification()
    stamp, nonce = headers["Wechatpay-Timestamp"], headers["Wechatpay-Nonce"]
    headers["Wechatpay-Signature"] = sign(rsa_key("stranger"), answer_text(stamp, nonce, body))
    assert refused(headers, body).code == "unverified"


def test_a_notification_older_than_five_minutes_is_refused() -> None:
    refusal = refused(*notification(timestamp=NOW - 301))
    assert (refusal.code, refusal.status) == ("unverified", 401)
    assert "stale" in refusal.message


def test_a_signed_ciphertext_that_does_not_decrypt_is_refused() -> None:
    """Signed, but sealed under another APIv3 key, or a byte of it changed: not the merchant's."""
    other = notification(api_v3_key="another-merchants-apiv3-key-0123")
    assert refused(*other).code == "undecryptable"
    good = AESGCM(API_V3_KEY.encode()).encrypt(
        b"fdasflkja484", json.dumps(resource()).encode(), b"refund"
    )
    flipped = bytes([good[0] ^ 1]) + good[1:]
    refusal = refused(*notification(seal=flipped))
    assert (refusal.code, refusal.status) == ("undecryptable", 400)


def test_decrypt_checks_the_associated_data() -> None:
    sealed = AESGCM(API_V3_KEY.encode()).encrypt(b"nonce-0001", b"{}", b"refund")
    resource_ = {"ciphertext": base64.b64encode(sealed).decode(), "nonce": "nonce-0001"}
    assert decrypt(API_V3_KEY.encode(), {**resource_, "associated_data": "refund"}) == b"{}"
    with pytest.raises(NotificationRefused):
        decrypt(API_V3_KEY.encode(), {**resource_, "associated_data": "transaction"})


def test_another_merchants_refund_is_refused() -> None:
    refusal = refused(*notification(resource(mchid="1900000110")))
    assert (refusal.code, refusal.status) == ("wrong_mchid", 400)


@pytest.mark.parametrize(
    ("changes", "kw"),
    [
        ({"refund_status": "CLOSED"}, {}),  # the event says SUCCESS, the refund CLOSED
        ({}, {"algorithm": "AEAD_AES_128_GCM"}),
        ({"out_refund_no": ""}, {}),
    ],
)
def test_a_notification_not_of_the_documented_shape_is_refused(
    changes: dict[str, Any], kw: dict[str, Any]
) -> None:
    assert refused(*notification(resource(**changes), **kw)).code == "malformed"


def test_no_key_byte_is_in_a_refusal() -> None:
    refusal = refused(*notification(api_v3_key="another-merchants-apiv3-key-0123"))
    assert API_V3_KEY not in str(refusal) and "another" not in str(refusal)
