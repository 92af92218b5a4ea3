"""Identifiers: op_id minting; tenant, op_id and correlation id validation; printable labels;
the downstream idempotency key."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import threading
import time

from outbox.errors import InvalidIdentifier, InvalidInput

# ASCII-only allow-lists: no whitespace, no unicode look-alikes, no quoting characters.
TENANT_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
OP_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,79}")
# Correlation data (a model's tool-call id, a trace id) comes from elsewhere, so it may be
# longer and may hold base64's "/+=" too; it stays printable ASCII with no quoting characters.
CORRELATION_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+=-]{0,199}")
#: Every idempotency key Settled derives starts with it (what marks a downstream's effect ours).
KEY_PREFIX = "stl_"
TENANT_MAX = 63
OP_ID_MAX = 80
CORRELATION_ID_MAX = 200

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


def _checked(value: object, pattern: re.Pattern[str], *, field: str, rule: str) -> str:
    """Return ``value`` if it is a string ``pattern`` matches whole, else raise InvalidIdentifier.

    The message names the rule, never the value: a bad identifier may be anything the caller
    had at hand (a secret, a payee), and error texts end up in logs.
    """
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise InvalidIdentifier(
            f"{field} must match {pattern.pattern} ({rule})", code=f"invalid_{field}", field=field
        )
    return value


def validate_tenant(tenant: object) -> str:
    """Return ``tenant`` if it is a well-formed tenant name, else raise InvalidIdentifier."""
    return _checked(
        tenant, TENANT_RE, field="tenant", rule=f"lower-case ASCII, at most {TENANT_MAX}"
    )


def validate_op_id(op_id: object) -> str:
    """Return ``op_id`` if it is a well-formed op_id, else raise InvalidIdentifier."""
    return _checked(op_id, OP_ID_RE, field="op_id", rule=f"ASCII, at most {OP_ID_MAX}")


def validate_correlation_id(correlation_id: object) -> str:
    """Return ``correlation_id`` if it is a well-formed correlation id (a model's tool-call
    id, a trace id), else raise InvalidIdentifier."""
    return _checked(
        correlation_id,
        CORRELATION_ID_RE,
        field="correlation_id",
        rule=f"ASCII, at most {CORRELATION_ID_MAX}",
    )


def validate_label(value: object, *, field: str, max_length: int) -> str:
    """Return ``value`` if it is printable text of 1 to ``max_length`` characters (a run's
    title, an actor's name), else raise InvalidInput.

    Unicode is welcome; control and format characters, lone surrogates and NUL are not: they
    cannot be stored everywhere, and a database error would carry the statement's parameters.
    """
    if not isinstance(value, str) or not 0 < len(value) <= max_length or not value.isprintable():
        raise InvalidInput(
            f"{field} must be printable text of 1 to {max_length} characters",
            code=f"invalid_{field}",
            field=field,
        )
    return value


def derive_idempotency_key(secret: bytes, tenant: str, op_id: str) -> str:
    """The downstream idempotency key for ``(tenant, op_id)``: opaque, stable, 40 characters.

    Derived once at intake and stored on the operation; every later send reads the stored
    value, so rotating ``secret`` never changes the key of an existing operation.
    """
    mac = hmac.new(secret, b"settled-idempotency-key\x00", hashlib.sha256)
    mac.update(tenant.encode() + b"\x00" + op_id.encode())
    return KEY_PREFIX + base64.b32encode(mac.digest()).decode().rstrip("=").lower()[:36]
