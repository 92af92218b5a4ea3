"""Canonical intents and their keyed fingerprints (HMAC-SHA256, versioned keys).

A fingerprint is for comparison only: it tells whether two intents for one ``(tenant, op_id)``
are the same. It is keyed so that a leaked table of fingerprints cannot be reversed by
hashing guesses of low-entropy fields such as amounts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from outbox.errors import SettledError
from outbox.kinds import Intent


def canonical_params(intent: Intent) -> dict[str, Any]:
    """The intent as the JSON object that is stored and sent downstream."""
    return intent.model_dump(mode="json")


def canonical_bytes(kind: str, intent: Intent) -> bytes:
    """One byte string per intent: sorted keys, no whitespace, UTF-8."""
    doc = {"kind": kind, "params": canonical_params(intent)}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Fingerprinter:
    """Keyed fingerprints; ``current`` names the key new operations are fingerprinted with."""

    keys: Mapping[str, bytes]
    current: str

    def __post_init__(self) -> None:
        if self.current not in self.keys:
            raise ValueError("the current fingerprint key version has no key")
        if any(len(k) < 16 for k in self.keys.values()):
            raise ValueError("fingerprint keys must be at least 16 bytes")

    def fingerprint(self, kind: str, intent: Intent, version: str | None = None) -> str:
        version = version or self.current
        key = self.keys.get(version)
        if key is None:
            raise SettledError(
                "fingerprint key version is not configured",
                code="fingerprint_key_unknown",
                key_version=version,
            )
        return hmac.new(key, canonical_bytes(kind, intent), hashlib.sha256).hexdigest()

    def matches(self, kind: str, intent: Intent, version: str, fingerprint: str) -> bool:
        """Constant-time comparison with a stored fingerprint made under key ``version``."""
        return hmac.compare_digest(self.fingerprint(kind, intent, version), fingerprint)
