"""Identifiers: op_id minting, tenant and op_id validation, the downstream idempotency key."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import threading
import time

from outbox.errors import InvalidIdentifier

# ASCII-only allow-lists: no whitespace, no unicode look-alikes, no quoting characters.
TENANT_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
OP_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,79}")
TENANT_MAX = 63
OP_ID_MAX = 80

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_lock = threading.Lock()
_last: tuple[int, int] = (0, 0)


def _b32(value: int, length: int) -> str:
    out = []
    for _ in range(length):
        out.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(out))


def new_op_id(prefix: str = "op") -> str:
    """A new, unique, time-ordered op_id (ULID layout: 48-bit ms time + 80 random bits).

    Within one millisecond of one process, ids stay ordered: the random part is incremented.
    """
    global _last
    with _lock:
        ms = time.time_ns() // 1_000_000
        last_ms, last_rand = _last
        if ms <= last_ms:
            ms, rand = last_ms, last_rand + 1
        else:
            rand = int.from_bytes(os.urandom(10), "big") >> 1  # leave room to increment
        _last = (ms, rand)
    return f"{prefix}_{_b32(ms, 10)}{_b32(rand, 16)}"


def validate_tenant(tenant: object) -> str:
    """Return ``tenant`` if it is a well-formed tenant name, else raise InvalidIdentifier."""
    if not isinstance(tenant, str) or TENANT_RE.fullmatch(tenant) is None:
        raise InvalidIdentifier(
            f"tenant must match {TENANT_RE.pattern} (lower-case ASCII, at most {TENANT_MAX})",
            code="invalid_tenant",
            field="tenant",
        )
    return tenant


def validate_op_id(op_id: object) -> str:
    """Return ``op_id`` if it is a well-formed op_id, else raise InvalidIdentifier."""
    if not isinstance(op_id, str) or OP_ID_RE.fullmatch(op_id) is None:
        raise InvalidIdentifier(
            f"op_id must match {OP_ID_RE.pattern} (ASCII, at most {OP_ID_MAX})",
            code="invalid_op_id",
            field="op_id",
        )
    return op_id


def derive_idempotency_key(secret: bytes, tenant: str, op_id: str) -> str:
    """The downstream idempotency key for ``(tenant, op_id)``: opaque, stable, 40 characters.

    Derived once at intake and stored on the operation; every later send reads the stored
    value, so rotating ``secret`` never changes the key of an existing operation.
    """
    mac = hmac.new(secret, b"settled-idempotency-key\x00", hashlib.sha256)
    mac.update(tenant.encode() + b"\x00" + op_id.encode())
    return "stl_" + base64.b32encode(mac.digest()).decode().rstrip("=").lower()[:36]
