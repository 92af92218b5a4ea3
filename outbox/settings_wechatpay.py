"""One tenant's WeChat Pay merchant, as configured (``SETTLED_WECHATPAY_MERCHANTS``): its
merchant number, the serial and the private key of its API certificate (the request signer),
and WeChat Pay's platform public key and its id (the answers' verifier); and the merchant's
APIv3 key, which decrypts the refund-result notifications WeChat Pay posts to ``notify_url``.

Keys are read from a file path or given inline (``SecretStr``: never in a repr, a log or an
error text). Reading them is the gateway's (``workers.wechatpay_signing.merchant_keys``).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

#: A merchant number, a certificate serial, a public key id (``PUB_KEY_ID_...``): ASCII.
_ID = r"^[A-Za-z0-9_-]{1,64}$"
#: The APIv3 key's length: an AES-256 key, 32 bytes.
API_V3_KEY_LENGTH = 32


class WechatPayMerchant(BaseModel):
    """One tenant's merchant: ``mchid``; ``serial_no`` and the private key (``private_key`` PEM
    text, or ``private_key_file``) of its API certificate; WeChat Pay's platform public key
    (``platform_public_key`` PEM text, or ``platform_public_key_file``) and its id
    (``platform_serial``, the ``Wechatpay-Serial`` of its answers); ``api_v3_key``, the 32
    characters set on the merchant platform (APIv3 密钥), where notifications are taken."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mchid: str = Field(pattern=_ID)
    serial_no: str = Field(pattern=_ID)
    private_key: SecretStr | None = None
    private_key_file: Path | None = None
    platform_serial: str = Field(pattern=_ID)
    platform_public_key: str | None = None
    platform_public_key_file: Path | None = None
    #: The APIv3 key (AES-256-GCM of notifications); None: notifications are not taken.
    api_v3_key: SecretStr | None = None

    @model_validator(mode="after")
    def _one_source_each(self) -> WechatPayMerchant:
        if (self.private_key is None) == (self.private_key_file is None):
            raise ValueError("set exactly one of private_key and private_key_file")
        if (self.platform_public_key is None) == (self.platform_public_key_file is None):
            raise ValueError("set exactly one of platform_public_key and platform_public_key_file")
        if self.api_v3_key is not None:
            text = self.api_v3_key.get_secret_value()
            if not text.isascii() or len(text) != API_V3_KEY_LENGTH:
                raise ValueError(f"api_v3_key must be {API_V3_KEY_LENGTH} ASCII characters")
        return self

    def api_v3_key_bytes(self) -> bytes | None:
        """The APIv3 key, as the AES-256-GCM key (None: not configured)."""
        return None if self.api_v3_key is None else self.api_v3_key.get_secret_value().encode()

    def private_key_pem(self) -> bytes:
        """The merchant's private key, PEM (read from its file where it is one)."""
        if self.private_key is not None:
            return self.private_key.get_secret_value().encode()
        assert self.private_key_file is not None
        return self.private_key_file.read_bytes()

    def platform_public_key_pem(self) -> bytes:
        """WeChat Pay's platform public key, PEM."""
        if self.platform_public_key is not None:
            return self.platform_public_key.encode()
        assert self.platform_public_key_file is not None
        return self.platform_public_key_file.read_bytes()
