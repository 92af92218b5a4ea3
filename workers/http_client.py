"""The downstream over HTTP: one attempt per call, classified into the gateway's outcome values.

Never retries (the executor owns retries), never spends past the operation's deadline, and
splits transport errors by phase: nothing sent (connect, pool) vs maybe sent (read, write,
protocol). The protocol is documented in README.md, "Wire protocol".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import SecretStr

from outbox.kinds import Kind
from outbox.retry import parse_retry_after, remaining
from outbox.states import RejectReason
from workers import wire
from workers.gateway import (
    Accepted,
    Found,
    LookupMisuse,
    LookupOutcome,
    Misuse,
    NotExecuted,
    NotFound,
    NotSent,
    Receipt,
    Refused,
    SubmitOutcome,
    Unavailable,
    Unknown,
    receipt_matches,
)

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]

#: Nothing left the client: the request provably never reached the downstream.
_NOT_SENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
#: The request may have reached the downstream: its outcome is unknown.
_MAYBE_SENT_ERRORS = (
    httpx.ReadTimeout,
    httpx.WriteTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


def _utcnow() -> datetime:
    return datetime.now(UTC)


class HttpGateway:
    """The ``Gateway`` port over the Stripe-like HTTP protocol of README.md, "Wire protocol"."""

    def __init__(
        self,
        base_url: str,
        api_keys: Mapping[str, SecretStr],
        *,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        clock: Clock = _utcnow,
    ) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self._api_keys = dict(api_keys)
        self._timeout = timeout
        self._clock = clock
        self._client = httpx.Client(
            base_url=base_url,
            transport=transport or httpx.HTTPTransport(retries=0),
            follow_redirects=False,
            trust_env=False,
        )

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def __enter__(self) -> HttpGateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self,
        *,
        tenant: str,
        kind: Kind,
        idempotency_key: str,
        params: Mapping[str, Any],
        deadline: datetime,
    ) -> SubmitOutcome:
        """Send one attempt; never retries; never spends past ``deadline``."""
        key = self._api_keys.get(tenant)
        if key is None:
            log.warning(
                "submit refused locally: no API key for tenant=%s key=%s", tenant, idempotency_key
            )
            return Refused(RejectReason.PERMISSION_DENIED, "no_api_key", 0)
        timeout = self._timeout_until(deadline)
        if timeout is None:
            log.info("submit not sent: deadline passed tenant=%s key=%s", tenant, idempotency_key)
            return NotSent("deadline passed before sending")
        try:
            response = self._client.post(
                kind.endpoint,
                json=dict(params),
                headers=self._headers(key, deadline, idempotency_key),
                timeout=timeout,
            )
        except _NOT_SENT_ERRORS as exc:
            log.info(
                "submit not sent tenant=%s key=%s: %s", tenant, idempotency_key, type(exc).__name__
            )
            return NotSent(type(exc).__name__)
        except _MAYBE_SENT_ERRORS as exc:
            log.warning(
                "submit outcome unknown tenant=%s key=%s: %s",
                tenant,
                idempotency_key,
                type(exc).__name__,
            )
            return Unknown(type(exc).__name__)
        outcome = classify_submit(response, kind, params, now=self._clock())
        log.info(
            "submit tenant=%s key=%s status=%s proof=%s",
            tenant,
            idempotency_key,
            response.status_code,
            outcome.proof.value,
        )
        return outcome

    def lookup(
        self,
        *,
        tenant: str,
        kind: Kind,
        idempotency_key: str,
        params: Mapping[str, Any],
        deadline: datetime,
    ) -> LookupOutcome:
        """Ask what happened to ``idempotency_key``; the receipt is checked against ``params``."""
        key = self._api_keys.get(tenant)
        if key is None:
            return Unavailable("no API key configured for the tenant")
        timeout = self._timeout_until(deadline)
        if timeout is None:
            return Unavailable("deadline passed before sending")
        path = wire.LOOKUP_PATH.format(key=quote(idempotency_key, safe=""))
        try:
            response = self._client.get(
                path, headers=self._headers(key, deadline, None), timeout=timeout
            )
        except httpx.TransportError as exc:
            log.info(
                "lookup unavailable tenant=%s key=%s: %s",
                tenant,
                idempotency_key,
                type(exc).__name__,
            )
            return Unavailable(type(exc).__name__)
        outcome = classify_lookup(response, params)
        log.info(
            "lookup tenant=%s key=%s status=%s outcome=%s",
            tenant,
            idempotency_key,
            response.status_code,
            type(outcome).__name__,
        )
        return outcome

    def _timeout_until(self, deadline: datetime) -> float | None:
        left = remaining(deadline, self._clock())
        if left <= 0:
            return None
        return min(self._timeout, left)

    @staticmethod
    def _headers(
        api_key: SecretStr, deadline: datetime, idempotency_key: str | None
    ) -> dict[str, str]:
        headers = {
            wire.AUTHORIZATION: f"Bearer {api_key.get_secret_value()}",
            wire.DEADLINE: wire.format_deadline(deadline),
        }
        if idempotency_key is not None:
            headers[wire.IDEMPOTENCY_KEY] = idempotency_key
        return headers


def classify_submit(
    response: httpx.Response, kind: Kind, params: Mapping[str, Any], *, now: datetime
) -> SubmitOutcome:
    """What a submit response proves (DESIGN.md, "What an outcome proves")."""
    status = response.status_code
    if status in kind.contract.not_executed_statuses:
        retry_after = parse_retry_after(response.headers.get(wire.RETRY_AFTER), now)
        return NotExecuted(status, retry_after)
    body = _json_object(response)
    if 200 <= status < 300:
        receipt = _receipt(body)
        if receipt is None or receipt.status != "succeeded":
            return Unknown("2xx without a readable receipt", status)
        if not receipt_matches(params, receipt):
            return Misuse("receipt_mismatch", "the receipt does not match the intent", status)
        return Accepted(receipt)
    error_type, code = _error(body)
    if status in (401, 403):
        return Refused(RejectReason.PERMISSION_DENIED, code or f"http_{status}", status)
    if error_type == wire.IDEMPOTENCY_ERROR:
        if code == wire.KEY_IN_USE:
            return Unknown("an earlier request with this key is still in flight", status)
        return Misuse("idempotency_error", code or "idempotency error", status)
    if status == 409:
        return Unknown("conflict without an idempotency error body", status)
    if 400 <= status < 500 and error_type == wire.BUSINESS_ERROR:
        return Refused(RejectReason.BUSINESS_REJECTED, code or "business_error", status)
    if status in (400, 422) and error_type == wire.INVALID_REQUEST:
        return Refused(RejectReason.INVALID_PARAMS, code or "invalid_request", status)
    if status >= 500:
        return Unknown(f"server error {code or status}", status)
    # A status the protocol does not define (3xx, 404, 405, an unknown 4xx body): nobody can
    # tell whether it executed, and retrying will not change it; a person must look.
    return Misuse("unexpected_response", f"unexpected HTTP {status}", status)


def classify_lookup(response: httpx.Response, params: Mapping[str, Any]) -> LookupOutcome:
    """What a lookup response proves; a found record is checked against ``params``."""
    status = response.status_code
    body = _json_object(response)
    if status == 404 and _error(body)[1] == wire.KEY_NOT_FOUND:
        return NotFound()
    if status != 200:
        # A bare 404 is a missing route (no lookup API), not proof that the key is unknown.
        return Unavailable(f"lookup answered HTTP {status}")
    receipt = _receipt(body)
    if receipt is None or receipt.status not in ("succeeded", "rejected"):
        return Unavailable("lookup answered without a readable record")
    if not receipt_matches(params, receipt):
        return LookupMisuse("receipt_mismatch", "the recorded params do not match the intent")
    if receipt.status == "succeeded":
        return Found(receipt)
    _, code = _error(body)
    return Found(receipt, RejectReason.BUSINESS_REJECTED, code or "business_error")


def _json_object(response: httpx.Response) -> Mapping[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _receipt(body: Mapping[str, Any]) -> Receipt | None:
    reference, status, params = body.get("id"), body.get("status"), body.get("params")
    if not isinstance(reference, str) or not isinstance(status, str):
        return None
    if not isinstance(params, dict):
        return None
    return Receipt(reference=reference, status=status, params=params, raw=dict(body))


def _error(body: Mapping[str, Any]) -> tuple[str | None, str | None]:
    error = body.get("error")
    if not isinstance(error, dict):
        return None, None
    error_type, code = error.get("type"), error.get("code")
    return (
        error_type if isinstance(error_type, str) else None,
        code if isinstance(code, str) else None,
    )
