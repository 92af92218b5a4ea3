"""What a Stripe answer proves: Stripe's errors and refund objects as the gateway's outcome
values (DESIGN.md, "What an outcome proves"; docs/providers.md, "Pointing Settled at Stripe").

Pure: no I/O, no clock (``now`` is passed in). An error is read by its HTTP status and its
documented error object (``{"error": {"type", "code", "message", "param"}}``), as the SDK
raised it; a connection error by the phase its cause failed in (``workers.transport``'s
split for httpx, whose errors the Stripe gateway's HTTP client chains as the cause).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

import stripe

from outbox.downstream import (
    Accepted,
    Misuse,
    NotExecuted,
    NotSent,
    Receipt,
    Refused,
    SendPhase,
    SubmitOutcome,
    Unknown,
    receipt_misfit,
)
from outbox.retry import parse_retry_after
from outbox.states import RejectReason
from workers.transport import not_sent

#: Metadata names the gateway writes on every refund: it finds its refunds by the tenant and
#: the op id (the operation's identity); the key is checked where a refund echoes it.
TENANT_FIELD = "settled_tenant"
OP_ID_FIELD = "settled_op_id"
KEY_FIELD = "settled_idempotency_key"
PAYEE_FIELD = "payee"

#: invalid-request codes that are the business refusing the refund (the intent is well formed;
#: the payment cannot be refunded so): rejected as ``business_rejected``. Every other
#: invalid-request code is the caller's to fix: ``invalid_params``.
BUSINESS_CODES = frozenset(
    {
        "charge_already_refunded",
        "amount_too_large",
        "charge_disputed",
        "charge_expired_for_refund",
        "refund_disputed_payment",
        "insufficient_funds",
        "balance_insufficient",
        "payment_intent_unexpected_state",
    }
)
#: What a refund's ``status`` proves. ``succeeded``: the money went back (done). ``failed``
#: (the refund could not be made; the amount went back to the balance) and ``canceled``: not
#: done, for good. ``pending`` and ``requires_action``: Stripe took the refund on but has not
#: made it yet, and it may still fail: not done yet, not failed either (uncertain, looked up
#: again until it settles). Any other status is not read as proof of anything.
DONE_STATUSES = frozenset({"succeeded"})
NOT_DONE_STATUSES = frozenset({"failed", "canceled"})
PENDING_STATUSES = frozenset({"pending", "requires_action"})
#: ``Receipt.status`` of a refund not settled yet (never stored: it settles nothing).
PENDING = "pending"
#: The parameters a refunds list is filtered by: a 404 ``resource_missing`` on one of them is
#: Stripe saying it knows no such payment intent (or charge) in this account.
INTENT_PARAMS = frozenset({"payment_intent", "charge"})

Outcome = TypeVar("Outcome", bound=SubmitOutcome)
#: a ``failure_reason`` kept in a refusal's code (Stripe's are short snake_case words)
_FAILURE_REASON = re.compile(r"[a-z][a-z_]{0,59}", re.ASCII)


def classify_error(error: stripe.StripeError, *, now: datetime) -> SubmitOutcome:
    """What a Stripe error raised by a refund's create proves."""
    if isinstance(error, stripe.APIConnectionError):
        cause = error.__cause__
        unsent = not_sent(cause) if cause is not None else None
        if unsent is not None:  # nothing left the client: never reached Stripe
            return unsent
        return Unknown(type(cause).__name__ if cause is not None else "connection error")
    status = error.http_status or 0
    kind, code = error_of(error)
    if status == 429 or (status == 400 and code == "rate_limit"):
        retry_after = parse_retry_after((error.headers or {}).get("Retry-After"), now)
        return NotExecuted(429, retry_after)
    if status in (401, 403):
        return Refused(RejectReason.PERMISSION_DENIED, code or f"http_{status}", status)
    if kind == "idempotency_error":
        if status == 409:  # another request with this key is still being processed
            return Unknown("an earlier request with this key is still in flight", status)
        return Misuse("idempotency_error", code or "idempotency error", status)
    if status == 409:  # a lock timeout or conflict: Stripe may have processed it
        return Unknown(f"conflict {code or ''}".strip(), status)
    if status == 402 or kind == "card_error":
        return Refused(RejectReason.BUSINESS_REJECTED, code or "card_error", status)
    if status in (400, 404) and kind == "invalid_request_error":
        if code in BUSINESS_CODES:
            return Refused(RejectReason.BUSINESS_REJECTED, code, status)
        return Refused(RejectReason.INVALID_PARAMS, code or "invalid_request", status)
    if status >= 500:
        return Unknown(f"server error {code or status}", status)
    return Misuse("unexpected_response", f"unexpected HTTP {status}", status)


def error_of(error: stripe.StripeError) -> tuple[str | None, str | None]:
    """The error object's type and code (None where absent)."""
    body = error.json_body if isinstance(error.json_body, dict) else {}
    obj = body.get("error")
    if not isinstance(obj, dict):
        return None, error.code if isinstance(error.code, str) else None
    kind, code = obj.get("type"), obj.get("code")
    return (kind if isinstance(kind, str) else None, code if isinstance(code, str) else None)


def receipt_of(refund: Mapping[str, Any]) -> Receipt | None:
    """A refund object as a receipt: its fields in the refund intent's names (None when it is
    not a readable refund)."""
    reference, status = refund.get("id"), refund.get("status")
    amount, currency = refund.get("amount"), refund.get("currency")
    metadata = refund.get("metadata")
    if not isinstance(reference, str) or not isinstance(status, str):
        return None
    if not isinstance(amount, int) or not isinstance(currency, str):
        return None
    metadata = metadata if isinstance(metadata, Mapping) else {}
    params = {
        "order_id": refund.get("payment_intent") or refund.get("charge"),
        "amount_minor": amount,
        "currency": currency.upper(),
        "payee": metadata.get(PAYEE_FIELD),
    }
    if status in DONE_STATUSES:
        verdict = "succeeded"
    elif status in NOT_DONE_STATUSES:
        verdict = "rejected"
    elif status in PENDING_STATUSES:
        verdict = PENDING
    else:
        return None
    return Receipt(reference=reference, status=verdict, params=params, raw=dict(refund))


def misfit(receipt: Receipt, params: Mapping[str, Any], key: str) -> str | None:
    """Why ``receipt`` cannot settle the operation with ``key`` and intent ``params``
    (``outbox.downstream.receipt_misfit``; a refund echoes the key in its metadata)."""
    metadata = receipt.raw.get("metadata")
    echoed = metadata.get(KEY_FIELD) if isinstance(metadata, Mapping) else None
    return receipt_misfit(receipt, params, key, echoed)


def classify_refund(
    refund: Mapping[str, Any], params: Mapping[str, Any], key: str
) -> SubmitOutcome:
    """What a refund object answered to a create proves."""
    receipt = receipt_of(refund)
    if receipt is None:
        return Unknown("2xx without a readable refund", 200)
    wrong = misfit(receipt, params, key)
    if wrong is not None:
        return Misuse(wrong, f"the refund does not fit the intent ({wrong})", 200)
    if receipt.status == PENDING:
        # Taken on, not made yet: the reconciler looks it up until it settles.
        return Unknown(f"the refund is {refund.get('status')} at Stripe", 200)
    if receipt.status != "succeeded":
        return Refused(RejectReason.BUSINESS_REJECTED, refusal_code(refund), 200)
    return Accepted(receipt)


def refusal_code(refund: Mapping[str, Any]) -> str:
    """Why a ``failed`` or ``canceled`` refund is not done: ``refund_failed`` or
    ``refund_canceled``, with Stripe's ``failure_reason`` after a colon where it names one
    (``refund_failed:expired_or_canceled_card``)."""
    code = f"refund_{refund.get('status')}"
    reason = refund.get("failure_reason")
    if isinstance(reason, str) and _FAILURE_REASON.fullmatch(reason):
        return f"{code}:{reason}"
    return code


def answered(outcome: Outcome, request_id: str | None) -> Outcome:
    """``outcome`` with Stripe's ``Request-Id`` of the answer it was read from (a connection
    error or a check before sending has none)."""
    if request_id is None or isinstance(outcome, NotSent):
        return outcome
    return replace(outcome, request_id=request_id)


def intent_missing(error: stripe.StripeError) -> bool:
    """Stripe's 404 ``resource_missing`` for the payment intent (or charge) a request named:
    it knows no such intent in the account the key belongs to."""
    kind, code = error_of(error)
    return (
        error.http_status == 404
        and kind == "invalid_request_error"
        and code == "resource_missing"
        and param_of(error) in INTENT_PARAMS
    )


def param_of(error: stripe.StripeError) -> str | None:
    """The error object's ``param`` (None where absent)."""
    body = error.json_body if isinstance(error.json_body, dict) else {}
    obj = body.get("error")
    param = obj.get("param") if isinstance(obj, dict) else None
    return param if isinstance(param, str) else None


def classify_intent_error(error: stripe.StripeError, *, now: datetime) -> SubmitOutcome:
    """What an error reading the payment intent (before the refund's create) proves: the
    refund was not sent, whatever the read's fate. Refused where Stripe refuses our key (401,
    403) or knows no such intent (404: no refund of it can be made, the intent is the caller's
    to fix); not executed on a 429; otherwise not sent (tried again by time)."""
    status = error.http_status or 0
    kind, code = error_of(error)
    if isinstance(error, stripe.APIConnectionError) and error.__cause__ is not None:
        unsent = not_sent(error.__cause__)
        if unsent is not None:  # nothing left the client: where it stopped
            return unsent
    if isinstance(error, stripe.APIConnectionError) or status >= 500:
        # The read may have reached Stripe; the refund's create was never sent.
        detail = f"the payment intent could not be read ({type(error).__name__}): not sent"
        return NotSent(detail, SendPhase.BEFORE)
    if status == 429 or (status == 400 and code == "rate_limit"):
        retry_after = parse_retry_after((error.headers or {}).get("Retry-After"), now)
        return NotExecuted(429, retry_after)
    if status in (401, 403):
        return Refused(RejectReason.PERMISSION_DENIED, code or f"http_{status}", status)
    if status in (400, 404) and kind == "invalid_request_error":
        return Refused(RejectReason.INVALID_PARAMS, code or "invalid_request", status)
    detail = f"the payment intent could not be read (HTTP {status}): not sent"
    return NotSent(detail, SendPhase.BEFORE)


def classify_intent(
    intent: Mapping[str, Any], params: Mapping[str, Any]
) -> Refused | NotSent | None:
    """Why the refund may not be sent against ``intent`` (Stripe's payment intent object), or
    None where it may: a refund is made in the charge's currency whatever the intent says, so
    an intent in another currency is refused (``invalid_params``: the caller's to fix with a
    new operation) before anything is sent."""
    currency = intent.get("currency")
    if not isinstance(currency, str) or intent.get("id") != params.get("order_id"):
        return NotSent("the payment intent is not readable: not sent", SendPhase.BEFORE)
    if currency.upper() != str(params.get("currency", "")).upper():
        return Refused(RejectReason.INVALID_PARAMS, "currency_mismatch", 200)
    return None
