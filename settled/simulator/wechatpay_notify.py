"""The refund-result notification (退款结果通知) of the simulator's WeChat Pay mode, written
from WeChat Pay's documentation of it apart from the gateway side's reader
(``workers.wechatpay_notify``), so that a mistake in one is not repeated in the other.

``POST /_control/wechatpay/notify`` (``wechatpay_control``) with ``tenant``, ``key`` (the
``out_refund_no``) and ``url`` (the merchant's ``notify_url``) posts the notification of that
refund as WeChat Pay does: JSON ``{id, create_time, event_type, resource_type, summary,
resource}``, ``resource`` AES-256-GCM under the merchant's APIv3 key (registered with the
merchant: ``api_v3_key``), the whole signed with the platform key like an answer. It answers
what was sent (``sent``: headers and body, so a test can replay or alter it) and how the
merchant answered (``answer``). ``timestamp`` signs with another time (a replay of an old
notification).
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from settled.simulator.state import Simulator
from settled.simulator.wechatpay import (
    _ENDED,
    Merchant,
    WechatPayMode,
    refund_object,
)
from settled.simulator.wechatpay_signatures import SCHEMA, answer_text, sign

_CHINA = timezone(timedelta(hours=8))
#: refund status -> event type and summary
_EVENTS = {
    "SUCCESS": ("REFUND.SUCCESS", "退款成功"),
    "CLOSED": ("REFUND.CLOSED", "退款关闭"),
    "ABNORMAL": ("REFUND.ABNORMAL", "退款异常"),
}


def merchant_of(mode: WechatPayMode, tenant: str) -> Merchant:
    """The merchant registered for ``tenant``; KeyError where there is none."""
    with mode.lock:
        found = [m for m in mode.merchants.values() if m.tenant == tenant]
    if not found:
        raise KeyError(f"no merchant registered for tenant {tenant}")
    return found[0]


def refund_of(sim: Simulator, tenant: str, key: str) -> dict[str, Any]:
    """The settled refund with ``out_refund_no`` ``key`` (as a query answers it); KeyError
    where the ledger has none (a refused create made none; a refund PROCESSING has no
    result to notify yet)."""
    record = sim.ledger.record(tenant, key, not_before=sim.retention_floor())
    outcome = record.outcome if record is not None else None
    if outcome is None:
        raise KeyError(f"no settled refund with out_refund_no {key}")
    if outcome.get("status") == "succeeded":
        return refund_object(outcome, "SUCCESS")
    code = str((outcome.get("error") or {}).get("code") or "")
    if code not in _ENDED:
        raise KeyError(f"no refund with out_refund_no {key} (its create was refused)")
    return refund_object(outcome, _ENDED[code])


def notification(
    mode: WechatPayMode, merchant: Merchant, refund: dict[str, Any], *, timestamp: int | None
) -> tuple[dict[str, str], bytes]:
    """The notification of ``refund`` to ``merchant``: its headers and body, signed."""
    if merchant.api_v3_key is None:
        raise ValueError("the merchant registered no api_v3_key")
    status = str(refund["status"])
    event_type, summary = _EVENTS[status]
    resource = {
        "mchid": merchant.mchid,
        "out_trade_no": refund["out_trade_no"],
        "transaction_id": refund["transaction_id"],
        "out_refund_no": refund["out_refund_no"],
        "refund_id": refund["refund_id"],
        "refund_status": status,
        "user_received_account": refund["user_received_account"],
        "amount": {
            name: refund["amount"][name]
            for name in ("total", "refund", "payer_total", "payer_refund")
        },
    }
    if "success_time" in refund:
        resource["success_time"] = refund["success_time"]
    nonce, associated = secrets.token_hex(6), "refund"
    sealed = AESGCM(merchant.api_v3_key).encrypt(
        nonce.encode(), json.dumps(resource, ensure_ascii=False).encode(), associated.encode()
    )
    created = datetime.now(UTC).astimezone(_CHINA).isoformat(timespec="seconds")
    body = json.dumps(
        {
            "id": "EV-" + secrets.token_hex(12),
            "create_time": created,
            "resource_type": "encrypt-resource",
            "event_type": event_type,
            "summary": summary,
            "resource": {
                "original_type": "refund",
                "algorithm": "AEAD_AES_256_GCM",
                "ciphertext": base64.b64encode(sealed).decode(),
                "associated_data": associated,
                "nonce": nonce,
            },
        },
        ensure_ascii=False,
    ).encode()
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    sign_nonce = secrets.token_hex(16)
    headers = {
        "Content-Type": "application/json",
        "Wechatpay-Timestamp": stamp,
        "Wechatpay-Nonce": sign_nonce,
        "Wechatpay-Signature": sign(mode.platform_key, answer_text(stamp, sign_nonce, body)),
        "Wechatpay-Serial": mode.platform_serial,
        "Wechatpay-Signature-Type": SCHEMA,
    }
    return headers, body
