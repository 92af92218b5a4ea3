"""What an Alipay answer proves: the verified response nodes of ``alipay.trade.refund`` and
``alipay.trade.fastpay.refund.query`` as the gateway's outcome values (DESIGN.md, "What an
outcome proves"; docs/providers.md, "Pointing Settled at Alipay").

Pure: no I/O, no clock, no keys. Only a node whose signature verified is read here
(``workers.alipay_gateway``); an answer that does not verify proves nothing and never gets here.

Alipay answers every call with a ``code`` (``10000`` success, ``20000`` service unavailable,
``20001`` authorisation, ``40001`` missing argument, ``40002`` invalid argument, ``40004``
business failure, ``40006`` insufficient permission) and, where it is not ``10000``, a
``sub_code`` that says why. What each proves:

- ``10000`` with ``fund_change`` ``Y``: this call moved the money: done, where the answer
  echoes this refund's amount (``send_back_fee``); else the lookup says what it was.
- ``10000`` with ``fund_change`` ``N``: this call moved no money. It does not say the refund
  was not made: a repeat of an ``out_request_no`` already refunded answers ``N`` too (the money
  moved the first time). Uncertain until the query answers.
- ``20000`` and ``40004 ACQ.SYSTEM_ERROR``: Alipay may have processed it: uncertain.
- ``40004`` with a documented business refusal: not done; ``ACQ.DISCORDANT_REPEAT_REQUEST``
  (the refund number used with other parameters) is misuse; an undocumented ``40004``
  sub-code proves nothing (uncertain).
- ``20001``, ``40006`` and the credential sub-codes of ``40002``: our credentials' fault, never
  retried; every other ``40001`` / ``40002``: the caller's to fix.

A query whose answer names no refund (no ``refund_status``, no ``refund_amount``) is
"not found as far as Alipay shows now": the refund may not have arrived, may have failed, or
may still be processing (Alipay makes some refunds asynchronously). It is ``LookupNotFound``,
which the reconciler trusts only past quiescence: the refund kind's processing time and the
delay bound of Alipay's contract (``outbox.provider_contracts``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from outbox.downstream import (
    Accepted,
    Found,
    LookupMisuse,
    LookupNotFound,
    LookupOutcome,
    Misuse,
    Receipt,
    Refused,
    SubmitOutcome,
    Unavailable,
    Unknown,
    receipt_misfit,
)
from outbox.states import RejectReason

#: The one currency Alipay's domestic refunds are made in; an intent in another is refused
#: before sending (``currency_not_supported``).
CURRENCY = "CNY"
#: The response node of each method (``{"<node>": {...}, "sign": "..."}``).
REFUND_NODE = "alipay_trade_refund_response"
QUERY_NODE = "alipay_trade_fastpay_refund_query_response"
#: The node Alipay answers with where the method itself could not be called.
ERROR_NODE = "error_response"

SUCCESS = "10000"
UNAVAILABLE = "20000"
AUTHORISATION = "20001"
MISSING_ARGUMENT = "40001"
INVALID_ARGUMENT = "40002"
BUSINESS_FAILED = "40004"
INSUFFICIENT_PERMISSION = "40006"

#: ``40004`` sub-codes of ``alipay.trade.refund`` that are the business refusing the refund:
#: nothing was refunded (``business_rejected``).
BUSINESS_SUB_CODES = frozenset(
    {
        "ACQ.SELLER_BALANCE_NOT_ENOUGH",  # the merchant's balance cannot cover it
        "ACQ.REFUND_AMT_NOT_EQUAL_TOTAL",  # more than is left to refund
        "ACQ.REASON_TRADE_BEEN_FREEZEN",  # the trade is frozen
        "ACQ.TRADE_NOT_EXIST",  # no such trade
        "ACQ.TRADE_HAS_FINISHED",  # the trade is finished: no refund any more
        "ACQ.TRADE_STATUS_ERROR",  # the trade is not in a state that refunds
        "ACQ.TRADE_NOT_ALLOW_REFUND",  # this trade may not be refunded
        "ACQ.REASON_TRADE_REFUND_FEE_ERR",  # the refund amount is not valid for the trade
        "ACQ.REFUND_FEE_ERROR",  # the refund amount is wrong
        "ACQ.REFUND_CHARGE_ERROR",  # the refund of the fee failed
    }
)
#: ``40004`` sub-codes that are the caller's to fix (``invalid_params``).
INVALID_SUB_CODES = frozenset({"ACQ.INVALID_PARAMETER"})
#: The refund number was used before with other parameters: Alipay keeps the first.
DISCORDANT_REPEAT = "ACQ.DISCORDANT_REPEAT_REQUEST"
#: ``40002`` sub-codes that are our credentials' fault, not the intent's (``permission_denied``):
#: the app id, the signature, its type.
CREDENTIAL_SUB_CODES = frozenset(
    {"isv.invalid-app-id", "isv.invalid-signature", "isv.invalid-signature-type"}
)
#: The query's ``refund_status`` of a refund made.
REFUND_SUCCESS = "REFUND_SUCCESS"

_YUAN = re.compile(r"(0|[1-9][0-9]{0,11})(\.[0-9]{1,2})?", re.ASCII)


def yuan(amount_minor: int) -> str:
    """Fen as Alipay's amount in yuan with two decimals (``10000`` as ``"100.00"``)."""
    return f"{Decimal(amount_minor).scaleb(-2):.2f}"


def fen(amount: object) -> int | None:
    """Alipay's amount in yuan (``"100.00"``) as fen; None where it is not one."""
    if not isinstance(amount, str) or _YUAN.fullmatch(amount) is None:
        return None
    return int(Decimal(amount) * 100)


def reference_of(trade_no: object, out_request_no: str) -> str | None:
    """The refund's reference: Alipay's trade number and our refund number (Alipay gives a
    partial refund no id of its own); None where the trade number is not a string."""
    if not isinstance(trade_no, str) or not trade_no:
        return None
    return f"{trade_no}:{out_request_no}"


def receipt_of(
    node: Mapping[str, Any], amount: object, params: Mapping[str, Any], key: str
) -> Receipt | None:
    """A refund Alipay answered for, as a receipt in the refund intent's names; ``amount`` the
    answer's amount of this refund (yuan). The payee is not Alipay's (a refund goes back the
    way the buyer paid): it is not sent, and the receipt carries the intent's."""
    reference = reference_of(node.get("trade_no"), key)
    minor = fen(amount)
    if reference is None or minor is None:
        return None
    echoed = {
        "order_id": node.get("out_trade_no"),
        "amount_minor": minor,
        "currency": CURRENCY,
        "payee": params.get("payee"),
    }
    return Receipt(reference=reference, status="succeeded", params=echoed, raw=dict(node))


def classify_refund(node: Mapping[str, Any], params: Mapping[str, Any], key: str) -> SubmitOutcome:
    """What a verified ``alipay_trade_refund_response`` (or ``error_response``) proves."""
    code, sub_code = _str(node.get("code")), _str(node.get("sub_code"))
    if code == SUCCESS:
        return _refunded(node, params, key)
    named = sub_code or f"code_{code}"
    if code == UNAVAILABLE:
        return Unknown(f"Alipay answered {code} {named}: it may have processed the refund")
    if code in (AUTHORISATION, INSUFFICIENT_PERMISSION):
        return Refused(RejectReason.PERMISSION_DENIED, named, 200)
    if code == INVALID_ARGUMENT and sub_code in CREDENTIAL_SUB_CODES:
        return Refused(RejectReason.PERMISSION_DENIED, named, 200)
    if code in (MISSING_ARGUMENT, INVALID_ARGUMENT):
        return Refused(RejectReason.INVALID_PARAMS, named, 200)
    if code == BUSINESS_FAILED:
        if sub_code in BUSINESS_SUB_CODES:
            return Refused(RejectReason.BUSINESS_REJECTED, named, 200)
        if sub_code in INVALID_SUB_CODES:
            return Refused(RejectReason.INVALID_PARAMS, named, 200)
        if sub_code == DISCORDANT_REPEAT:
            return Misuse("idempotency_error", "the refund number was used with other params", 200)
        # ACQ.SYSTEM_ERROR, and any sub-code Alipay does not document for refunds
        return Unknown(f"Alipay answered {code} {named}: not proof that nothing was done")
    return Misuse("unexpected_response", f"Alipay answered code {code or 'none'}", 200)


def _refunded(node: Mapping[str, Any], params: Mapping[str, Any], key: str) -> SubmitOutcome:
    """A ``10000`` answer to a refund: by ``fund_change`` and the amount it echoes."""
    fund_change = node.get("fund_change")
    if fund_change == "N":
        # No money moved by this call: a repeat of a refund already made, or one not made
        # (yet). Only the query can tell.
        return Unknown("fund_change N: this call moved no money; the query tells", 200)
    if fund_change != "Y":
        return Unknown("10000 without fund_change", 200)
    if node.get("send_back_fee") is None:
        # Done, but of which amount the answer does not say (refund_fee is the trade's total
        # refunded so far): the query, which echoes this refund's amount, settles it.
        return Unknown("fund_change Y without this refund's amount; the query tells", 200)
    receipt = receipt_of(node, node.get("send_back_fee"), params, key)
    if receipt is None:
        return Misuse("receipt_unreadable", "the refund answer is not readable", 200)
    wrong = receipt_misfit(receipt, params, key, None)
    if wrong is not None:
        return Misuse(wrong, f"the refund does not fit the intent ({wrong})", 200)
    return Accepted(receipt)


def classify_query(node: Mapping[str, Any], params: Mapping[str, Any], key: str) -> LookupOutcome:
    """What a verified ``alipay_trade_fastpay_refund_query_response`` proves."""
    code, sub_code = _str(node.get("code")), _str(node.get("sub_code"))
    if code == BUSINESS_FAILED and sub_code == "ACQ.TRADE_NOT_EXIST":
        return LookupNotFound()  # no such trade: no refund on it either
    if code != SUCCESS:
        return Unavailable(f"the refund query answered {code or 'no code'} {sub_code}".strip())
    status, amount = node.get("refund_status"), node.get("refund_amount")
    if status is None and amount is None:
        # Empty: not received, failed, or still processing. Not proof of "not done" until
        # quiescence has passed (the reconciler's rule, by the contract's bounds).
        return LookupNotFound()
    if status != REFUND_SUCCESS:
        return Unavailable(f"the refund query shows refund_status {status!r}")
    receipt = receipt_of(node, amount, params, key)
    if receipt is None:
        return Unavailable("the refund query's answer is not readable")
    wrong = receipt_misfit(receipt, params, key, node.get("out_request_no"))
    if wrong is not None:
        usable = wrong == "receipt_mismatch"
        return LookupMisuse(
            wrong, "the refund does not match the intent", receipt if usable else None
        )
    return Found(receipt)


def _str(value: object) -> str:
    return value if isinstance(value, str) else ""
