"""Helpers for tests of the Alipay gateway against the simulator's Alipay mode: an app key pair
(made once per test process, as a merchant makes one with Alipay's key tool), registered with
the simulator for a tenant."""

from __future__ import annotations

import functools

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from pydantic import SecretStr

from settled.simulator import SimulatorControl
from settled.simulator.alipay import GATEWAY
from workers.alipay_gateway import AlipayApp

APP_ID = "2021000000000001"


@functools.cache
def app_key(name: str = "app") -> rsa.RSAPrivateKey:
    """An RSA key pair of the app ``name`` (one per name and test process)."""
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def private_pem(key: rsa.RSAPrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode("ascii")


def public_pem(key: rsa.RSAPublicKey) -> str:
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode("ascii")


def register_app(control: SimulatorControl, tenant: str, app_id: str = APP_ID) -> AlipayApp:
    """Register the tenant's app with the simulator; the app as the gateway is configured."""
    key = app_key()
    control.add_alipay_app(tenant, app_id, public_pem(key.public_key()))
    return AlipayApp(app_id, SecretStr(private_pem(key)), control.alipay_public_key())


def unregistered_key_app(app: AlipayApp) -> AlipayApp:
    """``app`` signing with a private key the simulator was never given (a wrong key)."""
    return AlipayApp(app.app_id, SecretStr(private_pem(app_key("wrong"))), app.alipay_public_key)


def gateway_url(base: str) -> str:
    """The Alipay mode's gateway at the simulator (or proxy) ``base``."""
    return base.rstrip("/") + GATEWAY
