"""A WeChat Pay refund-result notification (退款结果通知, posted to ``notify_url``), read: what
it proves, once its signature and its decrypted body are checked (docs/providers.md,
"Pointing Settled at WeChat Pay").

WeChat Pay posts JSON ``{id, create_time, event_type, resource_type, summary, resource}``
signed like an answer (``Wechatpay-Timestamp``, ``-Nonce``, ``-Signature``, ``-Serial`` over
``timestamp\\nnonce\\nbody\\n``, the platform key). ``resource`` is AES-256-GCM under the
merchant's APIv3 key (``algorithm`` ``AEAD_AES_256_GCM``, base64 ``ciphertext`` with its tag,
``nonce``, ``associated_data``); inside, the refund: ``mchid``, ``out_trade_no``,
``out_refund_no``, ``refund_id``, ``refund_status`` (``SUCCESS``, ``CLOSED``, ``ABNORMAL``),
``amount`` ``{total, refund, payer_total, payer_refund}``.

Each check refuses with ``NotificationRefused`` (its ``code`` and the HTTP status WeChat Pay is
answered with): not signed by the tenant's platform key or too old (``unverified``), not
decryptable with the tenant's APIv3 key (``undecryptable``), another merchant's
(``wrong_mchid``), a body not of the documented shape (``malformed``). A notification that
passes is read as the answer to a query by ``out_refund_no`` would be
(``workers.wechatpay_classify.classify_lookup``): it is evidence of the same strength, checked
against the intent the same way. Pure: ``now`` is passed in; nothing is logged here.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from outbox.downstream import LookupOutcome
from workers.wechatpay_classify import CURRENCY, classify_lookup
from workers.wechatpay_signing import MerchantKeys, answer_unverified

ALGORITHM = "AEAD_AES_256_GCM"
RESOURCE_TYPE = "encrypt-resource"
ORIGINAL_TYPE = "refund"
#: event_type -> the refund_status it announces
EVENTS = {"REFUND.SUCCESS": "SUCCESS", "REFUND.ABNORMAL": "ABNORMAL", "REFUND.CLOSED": "CLOSED"}


class NotificationRefused(Exception):
    """The notification proves nothing: it is not taken (nothing is written)."""

    def __init__(self, code: str, message: str, status: int) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.status = code, message, status


@dataclass(frozen=True)
class RefundNotice:
    """A verified, decrypted notification: its id, and the refund in a query's shape."""

    id: str
    event_type: str
    out_refund_no: str
    refund: dict[str, Any]

    def as_lookup(self, params: Mapping[str, Any]) -> LookupOutcome:
        """What it proves about the operation with intent ``params`` (its key is
        ``out_refund_no``), exactly as a query's answer would."""
        return classify_lookup(200, self.refund, params, self.out_refund_no)


def _malformed(what: str) -> NotificationRefused:
    return NotificationRefused("malformed", f"the notification is not readable ({what})", 400)


def decrypt(api_v3_key: bytes, resource: Mapping[str, Any]) -> bytes:
    """``resource``'s plaintext (AES-256-GCM, its tag checked); NotificationRefused
    ``undecryptable`` where the key, the nonce, the associated data or a byte is not its own."""
    ciphertext, nonce = resource.get("ciphertext"), resource.get("nonce")
    associated = resource.get("associated_data", "")
    if not isinstance(ciphertext, str) or not isinstance(nonce, str) or not nonce:
        raise _malformed("resource")
    if not isinstance(associated, str):
        raise _malformed("associated_data")
    try:
        raw = base64.b64decode(ciphertext.encode("ascii"), validate=True)
        return AESGCM(api_v3_key).decrypt(nonce.encode(), raw, associated.encode() or None)
    except (InvalidTag, binascii.Error, UnicodeEncodeError, ValueError):
        raise NotificationRefused(
            "undecryptable", "the resource does not decrypt with the merchant's APIv3 key", 400
        ) from None


def read_notification(
    keys: MerchantKeys,
    api_v3_key: bytes,
    headers: Mapping[str, str],
    body: bytes,
    *,
    now: float,
) -> RefundNotice:
    """The refund a notification for ``keys``' merchant announces; NotificationRefused
    unless its signature verifies, it is fresh, it decrypts and it is this merchant's."""
    why = answer_unverified(keys, headers, body, now=now)
    if why is not None:
        raise NotificationRefused("unverified", f"the signature does not verify ({why})", 401)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise _malformed("not JSON") from None
    if not isinstance(data, dict):
        raise _malformed("not an object")
    event_type, resource = data.get("event_type"), data.get("resource")
    if event_type not in EVENTS or not isinstance(resource, dict):
        raise _malformed("event_type or resource")
    if data.get("resource_type") != RESOURCE_TYPE or resource.get("algorithm") != ALGORITHM:
        raise _malformed("resource_type or algorithm")
    if resource.get("original_type", ORIGINAL_TYPE) != ORIGINAL_TYPE:
        raise _malformed("original_type")
    try:
        refund = json.loads(decrypt(api_v3_key, resource))
    except (ValueError, RecursionError):
        raise _malformed("the resource is not JSON") from None
    if not isinstance(refund, dict):
        raise _malformed("the resource is not an object")
    if refund.get("mchid") != keys.mchid:
        raise NotificationRefused("wrong_mchid", "the refund is another merchant's", 400)
    number, status = refund.get("out_refund_no"), refund.get("refund_status")
    if not isinstance(number, str) or not number or status != EVENTS[event_type]:
        raise _malformed("out_refund_no or refund_status")
    return RefundNotice(str(data.get("id", "")), event_type, number, _as_queried(refund))


def _as_queried(refund: Mapping[str, Any]) -> dict[str, Any]:
    """The notified refund in the shape a query answers it (``status`` for
    ``refund_status``; the amount in CNY, the one currency of domestic refunds)."""
    amount = refund.get("amount")
    queried = {k: v for k, v in refund.items() if k != "refund_status"}
    queried["status"] = refund.get("refund_status")
    if isinstance(amount, Mapping):
        queried["amount"] = {**amount, "currency": amount.get("currency", CURRENCY)}
    return queried
