"""The simulator's Alipay keys: its own RSA key pair, made at start (``settled simulator``) or
when first needed (a simulator in a test's thread), never stored, never the same twice; and the
apps registered with it (app id -> tenant and the app's public key). Thread-safe."""

from __future__ import annotations

import base64
import hashlib
import threading

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa


class AlipayKeys:
    """Alipay's side of RSA2: it signs its answers and checks each app's requests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._private: rsa.RSAPrivateKey | None = None
        self._apps: dict[str, tuple[str, rsa.RSAPublicKey]] = {}

    def _key(self) -> rsa.RSAPrivateKey:
        with self._lock:
            if self._private is None:
                self._private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            return self._private

    def fingerprint(self) -> str:
        """The SHA-256 of Alipay's public key (DER), in hex: which key pair this run made,
        for a log line."""
        public = self._key().public_key()
        der = public.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return hashlib.sha256(der).hexdigest()

    def public_key_pem(self) -> str:
        """Alipay's public key, as an app's configuration takes it."""
        public = self._key().public_key()
        pem = public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return pem.decode("ascii")

    def sign(self, text: str) -> str:
        """RSA2 over ``text`` (an answer's response node, exactly as it is sent)."""
        signature = self._key().sign(text.encode("utf-8"), padding.PKCS1v15(), hashes.SHA256())
        return base64.b64encode(signature).decode("ascii")

    def add_app(self, app_id: str, tenant: str, public_key_pem: str) -> None:
        """Register (or re-key) an app of ``tenant``; ValueError for a key that is not RSA."""
        key = serialization.load_pem_public_key(public_key_pem.encode())
        if not isinstance(key, rsa.RSAPublicKey):
            raise ValueError("app_public_key must be an RSA public key")
        with self._lock:
            self._apps[app_id] = (tenant, key)

    def tenant_of(self, app_id: str) -> str | None:
        with self._lock:
            app = self._apps.get(app_id)
        return None if app is None else app[0]

    def verify(self, app_id: str, content: str, signature: str) -> bool:
        """Whether ``signature`` is the app's RSA2 signature of ``content``."""
        with self._lock:
            app = self._apps.get(app_id)
        if app is None:
            return False
        try:
            raw = base64.b64decode(signature, validate=True)
            app[1].verify(raw, content.encode("utf-8"), padding.PKCS1v15(), hashes.SHA256())
        except (InvalidSignature, ValueError):
            return False
        return True

    def clear(self) -> None:
        """Forget the apps (the key pair stays: clients configured with it keep working)."""
        with self._lock:
            self._apps.clear()
