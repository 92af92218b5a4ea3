"""WeChat Pay API v3 signatures as the platform side makes and checks them, written from WeChat
Pay's documentation of its signatures apart from the gateway's (``workers.wechatpay_signing``),
so that a mistake in one is not repeated in the other.

``WECHATPAY2-SHA256-RSA2048``: SHA256-RSA (PKCS#1 v1.5), base64; a request signs
``METHOD\\nURL\\ntimestamp\\nnonce\\nbody\\n`` (in ``Authorization``), an answer
``timestamp\\nnonce\\nbody\\n`` (in ``Wechatpay-Signature``, with ``Wechatpay-Timestamp``,
``Wechatpay-Nonce`` and ``Wechatpay-Serial``).
"""

from __future__ import annotations

import base64
import binascii

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

SCHEMA = "WECHATPAY2-SHA256-RSA2048"
#: How old a request's timestamp may be (WeChat Pay refuses older ones: ``SIGN_ERROR``).
MAX_SKEW_SECONDS = 300
_WANTED = frozenset({"mchid", "nonce_str", "signature", "timestamp", "serial_no"})


def request_text(method: str, url: str, timestamp: str, nonce: str, body: bytes) -> bytes:
    """What a request's signature is over."""
    return f"{method}\n{url}\n{timestamp}\n{nonce}\n".encode() + body + b"\n"


def answer_text(timestamp: str, nonce: str, body: bytes) -> bytes:
    """What an answer's signature is over."""
    return f"{timestamp}\n{nonce}\n".encode() + body + b"\n"


def sign(key: rsa.RSAPrivateKey, text: bytes) -> str:
    return base64.b64encode(key.sign(text, padding.PKCS1v15(), hashes.SHA256())).decode()


def verified(key: rsa.RSAPublicKey, text: bytes, signature: str) -> bool:
    try:
        key.verify(
            base64.b64decode(signature, validate=True), text, padding.PKCS1v15(), hashes.SHA256()
        )
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True


def authorization_fields(header: str) -> dict[str, str] | None:
    """The fields of a ``WECHATPAY2-SHA256-RSA2048`` ``Authorization`` (None: another scheme,
    or a field missing)."""
    scheme, _, rest = header.strip().partition(" ")
    if scheme != SCHEMA:
        return None
    fields: dict[str, str] = {}
    for part in rest.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or len(value) < 2 or value[0] != '"' or value[-1] != '"':
            return None
        fields[name] = value[1:-1]
    return fields if set(fields) >= _WANTED else None
