"""What a WeChat Pay answer proves: API v3's refund answers as the gateway's outcome values
(DESIGN.md, "What an outcome proves"; docs/providers.md, "Pointing Settled at WeChat Pay").

Pure: no I/O, no clock (``now`` is passed in). Only an answer whose signature verified is
read here (``workers.wechatpay_signing``): the gateway turns any other into ``Unknown``. An
error is read by its HTTP status and its documented body (``{"code", "message"}``); a refund
by its ``status``:

- ``SUCCESS``: the money went back (done);
- ``CLOSED``: the refund was closed, nothing refunded (not done);
- ``ABNORMAL``: the refund could not reach the payer (a closed card, a cancelled account); the
  money is not with the payer and WeChat Pay waits for the merchant to route it by hand
  (``apply-abnormal-refund`` or the merchant platform): not done, settled as rejected with
  ``refund_abnormal`` so the app and support see it, never retried under the same number;
- ``PROCESSING``: taken on, not made yet (uncertain: looked up until it settles).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

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
from outbox.retry import parse_retry_after
from outbox.states import RejectReason

#: The one currency WeChat Pay's domestic refunds are made in.
CURRENCY = "CNY"

#: Error codes that refuse for want of standing: a signature or merchant WeChat Pay does not
#: accept, no refund permission. Stop; never retried (``permission_denied``).
PERMISSION_CODES = frozenset({"SIGN_ERROR", "NO_AUTH", "MCH_NOT_EXISTS"})
#: Error codes of a well-formed refund the business refuses: the merchant's balance is short,
#: the payer's account is cancelled or frozen (``business_rejected``).
BUSINESS_CODES = frozenset({"NOT_ENOUGH", "USER_ACCOUNT_ABNORMAL"})
#: Error codes the caller can fix: a parameter wrong in form or against the order's rules (an
#: amount over what is left to refund, an order fully refunded), no such order, an app id that
#: is not the merchant's (``invalid_params``: a corrected *new* operation may follow).
INVALID_CODES = frozenset(
    {"PARAM_ERROR", "INVALID_REQUEST", "RESOURCE_NOT_EXISTS", "APPID_MCHID_NOT_MATCH"}
)
#: Refused before processing: the request was not executed (``NotExecuted``, 429).
NOT_EXECUTED_CODES = frozenset({"FREQUENCY_LIMITED"})
#: WeChat Pay's own failure: it may have processed the refund (``Unknown``).
UNKNOWN_CODES = frozenset({"SYSTEM_ERROR"})

DONE_STATUSES = frozenset({"SUCCESS"})
#: status -> the refusal code an operation is rejected with
NOT_DONE_STATUSES = {"CLOSED": "refund_closed", "ABNORMAL": "refund_abnormal"}
PENDING_STATUSES = frozenset({"PROCESSING"})
#: ``Receipt.status`` of a refund not settled yet (never stored: it settles nothing).
PENDING = "pending"


def code_of(body: Any) -> str | None:
    """An error body's ``code`` (None where it has none)."""
    code = body.get("code") if isinstance(body, Mapping) else None
    return code if isinstance(code, str) and code else None


def classify_error(
    status: int, body: Any, headers: Mapping[str, str], *, now: datetime
) -> SubmitOutcome:
    """What a verified non-2xx answer to a refund's create proves."""
    code = code_of(body)
    if status == 429 or code in NOT_EXECUTED_CODES:
        # WeChat Pay documents no Retry-After; one present is honoured.
        lowered = {name.lower(): value for name, value in headers.items()}
        return NotExecuted(429, parse_retry_after(lowered.get("retry-after"), now))
    if status >= 500 or code in UNKNOWN_CODES:
        return Unknown(f"WeChat Pay error {code or status}", status)
    if status == 401 or code in PERMISSION_CODES:
        return Refused(RejectReason.PERMISSION_DENIED, code or f"http_{status}", status)
    if code in BUSINESS_CODES:
        return Refused(RejectReason.BUSINESS_REJECTED, code, status)
    if code in INVALID_CODES and status in (400, 403, 404):
        return Refused(RejectReason.INVALID_PARAMS, code, status)
    if status == 403:
        return Refused(RejectReason.PERMISSION_DENIED, code or "http_403", status)
    # An undocumented answer proves nothing a machine may act on: a person looks.
    return Misuse("unexpected_response", f"undocumented answer HTTP {status} {code or ''}", status)


def receipt_of(refund: Any, params: Mapping[str, Any]) -> Receipt | None:
    """A refund as a receipt, its fields in the refund intent's names (None: not a readable
    refund). WeChat Pay refunds to the payer of the original payment and echoes no payee: the
    receipt's ``payee`` is the intent's."""
    if not isinstance(refund, Mapping):
        return None
    reference, status, amount = refund.get("refund_id"), refund.get("status"), refund.get("amount")
    if not isinstance(reference, str) or not isinstance(status, str):
        return None
    if not isinstance(amount, Mapping):
        return None
    refunded, currency = amount.get("refund"), amount.get("currency")
    if not isinstance(refunded, int) or isinstance(refunded, bool):
        return None
    if not isinstance(currency, str):
        return None
    if status in DONE_STATUSES:
        verdict = "succeeded"
    elif status in NOT_DONE_STATUSES:
        verdict = "rejected"
    elif status in PENDING_STATUSES:
        verdict = PENDING
    else:
        return None
    echoed = {
        "order_id": refund.get("out_trade_no"),
        "amount_minor": refunded,
        "currency": currency,
        "payee": params.get("payee"),
    }
    return Receipt(reference=reference, status=verdict, params=echoed, raw=dict(refund))


def misfit(receipt: Receipt, params: Mapping[str, Any], key: str) -> str | None:
    """Why ``receipt`` cannot settle the operation with ``key`` and intent ``params``
    (``outbox.downstream.receipt_misfit``; a refund echoes the key as ``out_refund_no``)."""
    echoed = receipt.raw.get("out_refund_no")
    return receipt_misfit(receipt, params, key, echoed if echoed is not None else "")


def classify_refund(refund: Any, params: Mapping[str, Any], key: str) -> SubmitOutcome:
    """What a verified 2xx answer (a refund) to a create proves."""
    receipt = receipt_of(refund, params)
    if receipt is None:
        return Unknown("2xx without a readable refund", 200)
    wrong = misfit(receipt, params, key)
    if wrong is not None:
        return Misuse(wrong, f"the refund does not fit the intent ({wrong})", 200)
    status = receipt.raw.get("status")
    if receipt.status == PENDING:
        # Taken on, not made yet: the reconciler looks it up until it settles.
        return Unknown(f"the refund is {status} at WeChat Pay", 200)
    if receipt.status == "rejected":
        return Refused(RejectReason.BUSINESS_REJECTED, NOT_DONE_STATUSES[str(status)], 200)
    return Accepted(receipt)


def classify_lookup(status: int, body: Any, params: Mapping[str, Any], key: str) -> LookupOutcome:
    """What a verified answer to a query by ``out_refund_no`` proves."""
    if status == 404 and code_of(body) == "RESOURCE_NOT_EXISTS":
        return LookupNotFound()  # no refund has this number (a refused create made none)
    if not 200 <= status < 300:
        return Unavailable(f"the query answered HTTP {status} {code_of(body) or ''}".strip())
    receipt = receipt_of(body, params)
    if receipt is None:
        return Unavailable("the refund is not readable")
    refund_status = receipt.raw.get("status")
    wrong = misfit(receipt, params, key)
    if wrong is not None:
        # Ours but different: what WeChat Pay did, unless it is not settled yet.
        usable = wrong == "receipt_mismatch" and receipt.status != PENDING
        return LookupMisuse(
            wrong, "the refund does not match the intent", receipt if usable else None
        )
    if receipt.status == PENDING:
        return Unavailable(f"the refund is {refund_status} at WeChat Pay", pending=True)
    if receipt.status == "succeeded":
        return Found(receipt)
    return Found(receipt, RejectReason.BUSINESS_REJECTED, NOT_DONE_STATUSES[str(refund_status)])
