"""WeChat Pay API v3 signatures (``WECHATPAY2-SHA256-RSA2048``): a request signed with the
merchant's private key, an answer verified with WeChat Pay's platform public key.

A request's signature is over ``METHOD\\nURL\\ntimestamp\\nnonce\\nbody\\n`` (the URL is the
path and query as sent) and travels in the ``Authorization`` header with the merchant number,
the nonce, the timestamp and the certificate serial. An answer's is over
``timestamp\\nnonce\\nbody\\n`` and travels in ``Wechatpay-Timestamp``, ``Wechatpay-Nonce``,
``Wechatpay-Signature`` and ``Wechatpay-Serial``. RSA PKCS#1 v1.5 with SHA-256, base64.

Pure apart from the key loading (``merchant_keys`` reads the configured files). Key material
stays on ``MerchantKeys`` attributes that no repr shows.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from outbox.settings_wechatpay import WechatPayMerchant

SCHEMA = "WECHATPAY2-SHA256-RSA2048"
TIMESTAMP = "Wechatpay-Timestamp"
NONCE = "Wechatpay-Nonce"
SIGNATURE = "Wechatpay-Signature"
SERIAL = "Wechatpay-Serial"
SIGNATURE_TYPE = "Wechatpay-Signature-Type"
#: How far an answer's timestamp may be from this process's clock (WeChat Pay's SDKs: 5 min):
#: an older signed answer replayed is no answer to this request.
MAX_SKEW_SECONDS = 300
#: The resolution of ``Wechatpay-Timestamp`` (Unix seconds, truncated): the true time lies in
#: ``[said, said + 1)``.
TIMESTAMP_RESOLUTION = 1.0
#: The ``Authorization`` fields, ``name="value"`` separated by commas.
_FIELD = re.compile(r'\s*([a-z_]+)="([^"]*)"\s*(?:,|$)')


class UnreadableKey(ValueError):
    """A configured key could not be read (the text names the setting, never the key)."""


@dataclass(frozen=True)
class MerchantKeys:
    """One tenant's keys, loaded: what signs its requests and verifies its answers."""

    mchid: str
    serial_no: str
    platform_serial: str
    private_key: rsa.RSAPrivateKey = field(repr=False)
    platform_key: rsa.RSAPublicKey = field(repr=False)


def merchant_keys(tenant: str, merchant: WechatPayMerchant) -> MerchantKeys:
    """``merchant``'s keys loaded; UnreadableKey naming the tenant where one cannot be read."""
    where = f"SETTLED_WECHATPAY_MERCHANTS[{tenant!r}]"
    try:
        private = serialization.load_pem_private_key(merchant.private_key_pem(), password=None)
    except (OSError, ValueError, TypeError, UnsupportedAlgorithm):
        raise UnreadableKey(f"{where}: the private key is not a readable PEM RSA key") from None
    try:
        public = serialization.load_pem_public_key(merchant.platform_public_key_pem())
    except (OSError, ValueError, UnsupportedAlgorithm):
        raise UnreadableKey(f"{where}: the platform public key is not a readable PEM key") from None
    if not isinstance(private, rsa.RSAPrivateKey) or not isinstance(public, rsa.RSAPublicKey):
        raise UnreadableKey(f"{where}: WeChat Pay's keys are RSA keys")
    return MerchantKeys(
        merchant.mchid, merchant.serial_no, merchant.platform_serial, private, public
    )


def message(*parts: str | bytes) -> bytes:
    """The signed text: each part followed by a newline."""
    return b"".join((p.encode() if isinstance(p, str) else p) + b"\n" for p in parts)


def sign(key: rsa.RSAPrivateKey, signed: bytes) -> str:
    """SHA256-RSA (PKCS#1 v1.5) of ``signed``, base64."""
    return base64.b64encode(key.sign(signed, padding.PKCS1v15(), hashes.SHA256())).decode()


def verify(key: rsa.RSAPublicKey, signed: bytes, signature: str) -> bool:
    """Whether ``signature`` (base64) is ``key``'s over ``signed``."""
    try:
        raw = base64.b64decode(signature.encode("ascii"), validate=True)
        key.verify(raw, signed, padding.PKCS1v15(), hashes.SHA256())
    except (InvalidSignature, binascii.Error, UnicodeEncodeError, ValueError):
        return False
    return True


def authorization(
    keys: MerchantKeys, method: str, url: str, body: bytes, *, timestamp: int, nonce: str
) -> str:
    """The ``Authorization`` header of a request (``url``: its path and query as sent)."""
    signature = sign(keys.private_key, message(method, url, str(timestamp), nonce, body))
    return (
        f'{SCHEMA} mchid="{keys.mchid}",nonce_str="{nonce}",signature="{signature}",'
        f'timestamp="{timestamp}",serial_no="{keys.serial_no}"'
    )


def parse_authorization(value: str) -> dict[str, str] | None:
    """An ``Authorization`` header's fields (None: not WeChat Pay's scheme, or malformed)."""
    scheme, _, rest = value.strip().partition(" ")
    if scheme != SCHEMA:
        return None
    fields: dict[str, str] = {}
    at = 0
    while at < len(rest):
        found = _FIELD.match(rest, at)
        if found is None:
            return None
        fields[found.group(1)] = found.group(2)
        at = found.end()
    wanted = {"mchid", "nonce_str", "signature", "timestamp", "serial_no"}
    return fields if wanted <= set(fields) else None


def answer_unverified(
    keys: MerchantKeys, headers: Mapping[str, str], body: bytes, *, now: float
) -> str | None:
    """Why an answer is not proven WeChat Pay's (None: its signature verifies): a missing
    field, another key's serial, a timestamp too far from ``now``, a signature that does not
    verify over the body as received. ``headers`` are looked up by lower-case name."""
    got = {name.lower(): value for name, value in headers.items()}
    timestamp, nonce = got.get(TIMESTAMP.lower()), got.get(NONCE.lower())
    signature, serial = got.get(SIGNATURE.lower()), got.get(SERIAL.lower())
    if not timestamp or not nonce or not signature or not serial:
        return "unsigned"
    kind = got.get(SIGNATURE_TYPE.lower())
    if kind is not None and kind != SCHEMA:
        return "signature_type"
    if serial != keys.platform_serial:
        return "unknown_serial"
    if not timestamp.isascii() or not timestamp.isdigit():
        return "timestamp"
    if abs(int(timestamp) - now) > MAX_SKEW_SECONDS:
        return "stale"
    if not verify(keys.platform_key, message(timestamp, nonce, body), signature):
        return "bad_signature"
    return None


def answer_time(headers: Mapping[str, str]) -> tuple[datetime, float] | None:
    """WeChat Pay's clock as an answer's signed ``Wechatpay-Timestamp`` says it, with its
    resolution (``TIMESTAMP_RESOLUTION``); None where it is absent or not Unix seconds. Read
    only of an answer whose signature verified (``answer_unverified``): the signature covers
    the timestamp, so no proxy's clock is taken for WeChat Pay's. ``headers`` are looked up by
    lower-case name."""
    got = {name.lower(): value for name, value in headers.items()}
    stamp = got.get(TIMESTAMP.lower())
    if not stamp or not stamp.isascii() or not stamp.isdigit():
        return None
    try:
        return datetime.fromtimestamp(int(stamp), UTC), TIMESTAMP_RESOLUTION
    except (OverflowError, OSError, ValueError):
        return None
