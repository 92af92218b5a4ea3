"""The wire protocol shared by the HTTP gateway and the simulator (docs/wire-protocol.md)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

#: Request headers.
AUTHORIZATION = "Authorization"
IDEMPOTENCY_KEY = "Idempotency-Key"
DEADLINE = "Settled-Deadline"
#: Marks a request as the deadline fence's probe (docs/wire-protocol.md, "The fence's probe"):
#: a submit no server may execute, sent to check that a downstream declared to enforce the
#: deadline refuses a late request.
PROBE = "Settled-Probe"
#: The value of ``PROBE`` on the fence's probe.
PROBE_DEADLINE_FENCE = "deadline-fence"
#: How an idempotency key of a probe starts: an operation's key starts with ``stl_``
#: (``outbox.ids``), so a probe's key is never one an operation has or will have.
PROBE_KEY_PREFIX = "settled-probe-"
#: The probe's body: none of the fields of any kind's intent, so a server that executes what
#: it validates refuses it (400 / 422) and never runs it.
PROBE_BODY = {"settled_probe": PROBE_DEADLINE_FENCE}
#: How far in the past the probe's ``Settled-Deadline`` lies: far beyond any clock offset
#: between Settled and a downstream that still works, so a fence refuses it whatever its clock.
PROBE_DEADLINE_AGO_SECONDS = 3600
#: Response headers.
REPLAYED = "Idempotent-Replayed"
RETRY_AFTER = "Retry-After"
#: The downstream's clock when it wrote the answer, RFC 3339 UTC with milliseconds (as
#: ``Settled-Deadline``): on every answer of a server that speaks this protocol, so a client can
#: measure how far the downstream's clock is from its own time base (``outbox.downstream_clock``).
SERVER_TIME = "Settled-Server-Time"
#: HTTP's own ``Date`` (RFC 9110, whole seconds): read where ``SERVER_TIME`` is absent.
DATE = "Date"
#: The resolution of each, in seconds: the true time lies in [said, said + resolution).
SERVER_TIME_RESOLUTION = 0.001
DATE_RESOLUTION = 1.0

#: Path of the lookup by idempotency key.
LOOKUP_PATH = "/v1/lookup/{key}"
#: Path of the optional list of effects since a time (the orphan-effect audit).
EFFECTS_PATH = "/v1/effects"
#: Effects per page of that list, at most.
EFFECTS_PAGE_MAX = 100

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


def server_time(headers: Mapping[str, str]) -> tuple[datetime, float] | None:
    """The downstream's clock as an answer's headers say it, with its resolution in seconds:
    ``Settled-Server-Time`` (milliseconds), else ``Date`` (whole seconds); None when neither
    is there or readable (a downstream that says no time: the contract's clock margin is
    assumed, as before). ``headers`` looks names up case-insensitively (httpx's ``Headers``)."""
    said = headers.get(SERVER_TIME)
    if said is not None:
        parsed = parse_deadline(said)
        if parsed is not None:
            return parsed, SERVER_TIME_RESOLUTION
    return http_date(headers)


def http_date(headers: Mapping[str, str]) -> tuple[datetime, float] | None:
    """The downstream's clock as HTTP's ``Date`` says it (whole seconds, truncated: the true
    time lies in ``[said, said + 1)``), with its resolution; None when it is absent or
    unreadable. What a provider that speaks its own API (Stripe, Alipay) says of its time."""
    date = headers.get(DATE)
    if date is None:
        return None
    try:
        when = parsedate_to_datetime(date)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return when.astimezone(UTC), DATE_RESOLUTION
