"""WeChat Pay for tests: merchant keys made per test run, an in-memory WeChat Pay that checks
each request's signature and signs each answer (for the gateway's table tests), and the
registration of a merchant with the simulator's WeChat Pay mode."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from pydantic import SecretStr

from outbox.settings_wechatpay import WechatPayMerchant
from settled.simulator.wechatpay_signatures import (
    SCHEMA,
    answer_text,
    authorization_fields,
    request_text,
    sign,
    verified,
)
from workers.wechatpay_signing import MerchantKeys, merchant_keys

MCHID = "1900000109"
SERIAL = "5157F09EFDC096DE15EBE81A47057A7232F1B8E1"
PLATFORM_SERIAL = "PUB_KEY_ID_0114232134912410000000000001"
#: The test merchant's APIv3 key (32 characters: the AES-256-GCM key of its notifications).
API_V3_KEY = "aPiV3kEy0123456789abcdefGHIJKLmn"


@cache
def rsa_key(name: str) -> rsa.RSAPrivateKey:
    """An RSA key made once per test run for ``name``."""
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def private_pem(key: rsa.RSAPrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def public_pem(key: rsa.RSAPrivateKey) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


def merchant(
    platform_pem: str | None = None,
    platform_serial: str = PLATFORM_SERIAL,
    *,
    mchid: str = MCHID,
    api_v3_key: str = API_V3_KEY,
) -> WechatPayMerchant:
    """The test merchant's settings (its key inline), verifying with ``platform_pem``."""
    return WechatPayMerchant(
        mchid=mchid,
        api_v3_key=SecretStr(api_v3_key),
        serial_no=SERIAL,
        private_key=SecretStr(private_pem(rsa_key("merchant"))),
        platform_serial=platform_serial,
        platform_public_key=platform_pem or public_pem(rsa_key("platform")),
    )


def keys(platform_pem: str | None = None, platform_serial: str = PLATFORM_SERIAL) -> MerchantKeys:
    return merchant_keys("acme", merchant(platform_pem, platform_serial))


Tamper = Callable[[dict[str, str], bytes], tuple[dict[str, str], bytes]]


@dataclass
class FakeWechatPay:
    """WeChat Pay API v3 in memory, for ``httpx.MockTransport``: checks every request's
    signature (else 401 ``SIGN_ERROR``), answers ``answer(request)`` (status, JSON body)
    signed with the platform key, then lets ``tamper`` change what arrives."""

    answer: Callable[[httpx.Request], tuple[int, Any]]
    tamper: Tamper | None = None
    requests: list[httpx.Request] = field(default_factory=list)
    signer: rsa.RSAPrivateKey = field(default_factory=lambda: rsa_key("platform"))
    serial: str = PLATFORM_SERIAL
    clock: Callable[[], float] = time.time

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        fields = authorization_fields(request.headers.get("Authorization", ""))
        url = request.url.raw_path.decode()
        ok = fields is not None and fields["mchid"] == MCHID and fields["serial_no"] == SERIAL
        if ok and fields is not None:
            text = request_text(
                request.method, url, fields["timestamp"], fields["nonce_str"], request.content
            )
            ok = verified(rsa_key("merchant").public_key(), text, fields["signature"])
        status, body = (
            (401, {"code": "SIGN_ERROR", "message": "签名错误"}) if not ok else self.answer(request)
        )
        raw = json.dumps(body, ensure_ascii=False).encode()
        stamp, nonce = str(int(self.clock())), "n" + str(len(self.requests))
        headers = {
            "Content-Type": "application/json",
            "Wechatpay-Timestamp": stamp,
            "Wechatpay-Nonce": nonce,
            "Wechatpay-Signature": sign(self.signer, answer_text(stamp, nonce, raw)),
            "Wechatpay-Serial": self.serial,
            "Wechatpay-Signature-Type": SCHEMA,
        }
        if self.tamper is not None:
            headers, raw = self.tamper(headers, raw)
        return httpx.Response(status, headers=headers, content=raw)


def register(url: str, tenant: str = "acme") -> WechatPayMerchant:
    """Register the test merchant with the simulator at ``url`` (its WeChat Pay mode); the
    merchant's settings, verifying with the platform key the simulator made."""
    answer = httpx.post(
        url.rstrip("/") + "/_control/wechatpay/merchants",
        json={
            "tenant": tenant,
            "mchid": MCHID,
            "serial_no": SERIAL,
            "public_key": public_pem(rsa_key("merchant")),
            "api_v3_key": API_V3_KEY,
        },
        timeout=5.0,
    )
    answer.raise_for_status()
    platform: Mapping[str, str] = answer.json()
    return merchant(platform["platform_public_key"], platform["platform_serial"])


def control(url: str, route: str, body: Mapping[str, Any]) -> Any:
    """A control call of the simulator's WeChat Pay mode (``processing``, ``settle``,
    ``notify``)."""
    answer = httpx.post(url.rstrip("/") + "/_control/wechatpay/" + route, json=body, timeout=5.0)
    answer.raise_for_status()
    return answer.json()


def order_total(tenant: str, order_id: str) -> int | None:
    """An ``SETTLED_WECHATPAY_ORDER_TOTALS`` function for settings tests: every order 100 yuan."""
    return 10000
