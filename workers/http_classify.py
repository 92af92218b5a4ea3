"""What a downstream's HTTP response proves: the classification of docs/wire-protocol.md, "How
the client classifies responses", as pure functions (DESIGN.md, "What an outcome proves").

``classify_submit`` and ``classify_lookup`` read a response that came back (its status, its
headers, its JSON body) and return the gateway's outcome value; a response that never came back
is the adapter's to classify by phase (``workers.http_client``). ``classify_probe`` reads the
answer to the deadline fence's probe (docs/wire-protocol.md, "The fence's probe"). Pure: no
I/O, no clock (``now`` is passed in); httpx is named for its types only and never loaded by
importing this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from outbox import wire
from outbox.downstream import (
    Accepted,
    Found,
    LookupMisuse,
    LookupNotFound,
    LookupOutcome,
    Misuse,
    NotExecuted,
    Receipt,
    Refused,
    SubmitOutcome,
    Unavailable,
    Unknown,
    receipt_misfit,
)
from outbox.kinds import Kind
from outbox.retry import parse_retry_after
from outbox.states import RejectReason

if TYPE_CHECKING:
    import httpx


def classify_submit(
    response: httpx.Response,
    kind: Kind,
    params: Mapping[str, Any],
    *,
    now: datetime,
    idempotency_key: str | None = None,
) -> SubmitOutcome:
    """What a submit response proves (DESIGN.md, "What an outcome proves").

    With ``idempotency_key``, a receipt naming another key is not this operation's receipt.
    """
    status = response.status_code
    if status in kind.contract.not_executed_statuses:
        retry_after = parse_retry_after(response.headers.get(wire.RETRY_AFTER), now)
        return NotExecuted(status, retry_after)
    body = _json_object(response)
    if _deadline_exceeded(status, body) and kind.contract.enforces_deadline:
        # The downstream promises to refuse a late request before any effect: the next
        # attempt gets a new lease, a new deadline and the same key. (Where it promises no
        # such thing, the answer is one the protocol does not define: a person must look.)
        return NotExecuted(status, None)
    if 200 <= status < 300:
        receipt = _receipt(body)
        if receipt is None or receipt.status != "succeeded":
            return Unknown("2xx without a readable receipt", status)
        misfit = receipt_misfit(
            receipt, params, idempotency_key, receipt.raw.get("idempotency_key")
        )
        if misfit is not None:
            return Misuse(misfit, _MISFITS[misfit], status)
        return Accepted(receipt, status)
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


def classify_lookup(
    response: httpx.Response, params: Mapping[str, Any], *, idempotency_key: str | None = None
) -> LookupOutcome:
    """What a lookup response proves; a found record is checked against ``params`` (and,
    with ``idempotency_key``, must name that key)."""
    status = response.status_code
    body = _json_object(response)
    if status == 404 and _error(body)[1] == wire.KEY_NOT_FOUND:
        return LookupNotFound()
    if status != 200:
        # A bare 404 is a missing route (no lookup API), not proof that the key is unknown.
        return Unavailable(f"lookup answered HTTP {status}")
    receipt = _receipt(body)
    if receipt is None or receipt.status not in ("succeeded", "rejected"):
        return Unavailable("lookup answered without a readable record")
    misfit = receipt_misfit(receipt, params, idempotency_key, receipt.raw.get("idempotency_key"))
    if misfit is not None:
        ours = misfit == "receipt_mismatch"  # our key, a storable id, other params
        return LookupMisuse(misfit, _MISFITS[misfit], receipt if ours else None)
    if receipt.status == "succeeded":
        return Found(receipt)
    _, code = _error(body)
    return Found(receipt, RejectReason.BUSINESS_REJECTED, code or "business_error")


@dataclass(frozen=True)
class FenceProbe:
    """What the deadline fence's probe found. ``verified`` only for the fence's own answer;
    ``detail`` says what came back, in words for the operator (never a secret)."""

    verified: bool
    detail: str


def classify_probe(response: httpx.Response) -> FenceProbe:
    """What the answer to the fence's probe proves: only ``408 deadline_error /
    deadline_exceeded`` shows a fence; anything else, a success above all, shows none."""
    status = response.status_code
    body = _json_object(response)
    if _deadline_exceeded(status, body):
        return FenceProbe(True, "refused a request past its deadline: 408 deadline_exceeded")
    error_type, code = _error(body)
    named = " ".join(part for part in (error_type, code) if part)
    answered = f"answered HTTP {status}" + (f" {named}" if named else "")
    if 200 <= status < 300:
        why = "it accepted a request past its deadline: it does not enforce the deadline"
    elif status in (401, 403):
        why = "the probe's API key was refused, so the fence could not be checked"
    elif status in (404, 405):
        why = "no submit endpoint of the kind at this URL"
    elif status in (400, 422):
        why = "it read a request past its deadline instead of refusing it: no fence"
    elif status == wire.DEADLINE_EXCEEDED_STATUS:
        why = "a 408 without deadline_error / deadline_exceeded is not the fence's answer"
    else:
        why = "not the fence's answer (408 deadline_exceeded)"
    return FenceProbe(False, f"{answered}: {why}")


def probe_unanswered(error: str) -> FenceProbe:
    """The probe got no answer (``error``: the transport error's name): nothing shows a fence."""
    return FenceProbe(False, f"no answer ({error}): the fence could not be checked")


#: Why a readable receipt is still not this operation's proof; each goes to review at once.
_MISFITS = {
    "receipt_mismatch": "the receipt does not match the intent",
    "receipt_key_mismatch": "the receipt names another idempotency key",
    "receipt_unreadable": "the receipt's reference is not a valid reference",
}


def _deadline_exceeded(status: int, body: Mapping[str, Any]) -> bool:
    """The fence's answer: the request arrived after its ``Settled-Deadline``."""
    return status == wire.DEADLINE_EXCEEDED_STATUS and _error(body) == (
        wire.DEADLINE_ERROR,
        wire.DEADLINE_EXCEEDED,
    )


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
