"""The wire protocol shared by the HTTP gateway and the simulator (docs/wire-protocol.md)."""

from __future__ import annotations

from datetime import UTC, datetime

#: Request headers.
AUTHORIZATION = "Authorization"
IDEMPOTENCY_KEY = "Idempotency-Key"
DEADLINE = "Settled-Deadline"
#: Response headers.
REPLAYED = "Idempotent-Replayed"
RETRY_AFTER = "Retry-After"

#: Path of the lookup by idempotency key.
LOOKUP_PATH = "/v1/lookup/{key}"

# Error ``type`` values of ``{"error": {"type", "code", "message"}}``.
INVALID_REQUEST = "invalid_request"
BUSINESS_ERROR = "business_error"
IDEMPOTENCY_ERROR = "idempotency_error"
AUTHENTICATION_ERROR = "authentication_error"
PERMISSION_ERROR = "permission_error"
RATE_LIMIT_ERROR = "rate_limit_error"
API_ERROR = "api_error"
NOT_FOUND_ERROR = "not_found"

#: ``code`` of the 409 answered while an earlier request with the same key is still running.
KEY_IN_USE = "idempotency_key_in_use"
#: ``code`` of the idempotency error: the key was first used with other params or another path.
KEY_REUSED = "idempotency_key_reused"
#: ``code`` of the lookup's 404 when the downstream has no record of the key.
KEY_NOT_FOUND = "idempotency_key_not_found"
#: ``code`` of a 503 answered before anything was processed.
NOT_PROCESSED = "not_processed"
#: Status, ``type`` and ``code`` of the answer to a request that arrived after its
#: ``Settled-Deadline``: refused before the idempotency layer marked the key and before any
#: effect (a downstream whose contract declares ``enforces_deadline`` promises it).
DEADLINE_EXCEEDED_STATUS = 408
DEADLINE_ERROR = "deadline_error"
DEADLINE_EXCEEDED = "deadline_exceeded"


def format_deadline(deadline: datetime) -> str:
    """RFC 3339 UTC with milliseconds, e.g. ``2026-01-31T12:00:00.250Z``."""
    if deadline.tzinfo is None:
        raise ValueError("deadline must be timezone-aware")
    utc = deadline.astimezone(UTC)
    return utc.strftime("%Y-%m-%dT%H:%M:%S.") + f"{utc.microsecond // 1000:03d}Z"


def parse_deadline(value: str) -> datetime | None:
    """The deadline a request carried; None when the header is absent or unreadable."""
    try:
        parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return None
    return parsed.astimezone(UTC)
