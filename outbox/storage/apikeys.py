"""API keys of the status API: adding one, the live key of a key id, revoking one.

Only the hash of a secret is stored here; making keys and checking secrets is
``outbox.apikeys``.
"""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.orm import Session

from outbox.db import db_now
from outbox.models import ApiKey

api_keys: Table = ApiKey.__table__  # type: ignore[assignment]

LIVE_KEY = select(api_keys.c.tenant, api_keys.c.key_id, api_keys.c.secret_hash).where(
    api_keys.c.key_id == bindparam("key_id"), api_keys.c.revoked_at.is_(None)
)
REVOKE_KEY = (
    update(api_keys)
    .where(api_keys.c.key_id == bindparam("k_key_id"), api_keys.c.revoked_at.is_(None))
    .values(revoked_at=db_now())
)


class StoredKey(NamedTuple):
    """A live key as stored: whose it is, and the hash of its secret."""

    tenant: str
    key_id: str
    secret_hash: str


def add_api_key(session: Session, *, tenant: str, key_id: str, secret_hash: str) -> ApiKey:
    """A new key row in ``session`` (flushed, not committed)."""
    row = ApiKey(tenant=tenant, key_id=key_id, secret_hash=secret_hash)
    session.add(row)
    session.flush()
    return row


def live_key(session: Session, key_id: str) -> StoredKey | None:
    """The unrevoked key ``key_id`` (None: no such key, or it was revoked)."""
    row = session.execute(LIVE_KEY, {"key_id": key_id}).first()
    return StoredKey(*row) if row is not None else None


def revoke_key(session: Session, key_id: str) -> bool:
    """Revoke the unrevoked key ``key_id`` (never committed here); False: no such live key."""
    result = session.execute(REVOKE_KEY, {"k_key_id": key_id})  # autoflushes, as ORM calls do
    revoked: bool = result.rowcount == 1  # type: ignore[attr-defined]
    return revoked
