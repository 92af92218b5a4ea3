"""Per-tenant API keys of the status API.

A key reads ``stk_<key_id>_<secret>``: ``key_id`` finds the row, the secret (256 random bits)
is checked against its stored SHA-256 in constant time. A fast hash is enough for a random
secret of that size (no dictionary to attack); the plaintext exists only in the answer to
``create_api_key`` and is never stored or logged.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from sqlalchemy.orm import Session

from outbox.errors import NotFound
from outbox.ids import validate_tenant
from outbox.models import ApiKey
from outbox.storage.apikeys import add_api_key, live_key, revoke_key

KEY_RE = re.compile(r"stk_([0-9a-f]{16})_([A-Za-z0-9_-]{43})")
#: compared against when no row matches, so a miss costs the same as a wrong secret
_DUMMY_HASH = hashlib.sha256(b"settled-no-such-key").hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who an accepted key speaks for."""

    tenant: str
    key_id: str


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_api_key(session: Session, *, tenant: str) -> tuple[ApiKey, str]:
    """A new key for ``tenant`` (flushed, not committed); the plaintext is returned once."""
    tenant = validate_tenant(tenant)
    key_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    row = add_api_key(session, tenant=tenant, key_id=key_id, secret_hash=_hash(secret))
    return row, f"stk_{key_id}_{secret}"


def authenticate(session: Session, presented: str | None) -> Principal | None:
    """The principal of a valid, unrevoked key; None for anything else."""
    match = KEY_RE.fullmatch(presented) if isinstance(presented, str) else None
    row = live_key(session, match.group(1)) if match is not None else None
    secret = match.group(2) if match is not None else ""
    ok = hmac.compare_digest(_hash(secret), row.secret_hash if row is not None else _DUMMY_HASH)
    if row is None or not ok:
        return None
    return Principal(row.tenant, row.key_id)


def revoke_api_key(session: Session, key_id: str) -> None:
    """Revoke a key (never committed here); NotFound if no such live key."""
    if not revoke_key(session, key_id):
        raise NotFound("no such active key", code="api_key_not_found")
