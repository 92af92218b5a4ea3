"""What each documented Alipay answer proves (``workers.alipay_classify``): one row per answer
of ``alipay.trade.refund`` and of ``alipay.trade.fastpay.refund.query``."""

from __future__ import annotations

from typing import Any

import pytest

from outbox.downstream import (
    Accepted,
    Found,
    LookupMisuse,
    LookupNotFound,
    Misuse,
    Refused,
    Unavailable,
    Unknown,
)
from outbox.states import RejectReason
from workers.alipay_classify import classify_query, classify_refund, fen, yuan

KEY = "stl_4f1c9a7e2b"
PARAMS = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P-7"}
TRADE = "2026120322001404500501234567"


def refunded(**changes: Any) -> dict[str, Any]:
    node = {
        "code": "10000",
        "msg": "Success",
        "trade_no": TRADE,
        "out_trade_no": "A1042",
        "buyer_logon_id": "159****5620",
        "fund_change": "Y",
        "refund_fee": "150.00",  # the trade's total refunded so far, not this refund's
        "send_back_fee": "100.00",
        "gmt_refund_pay": "2026-12-03 14:12:05",
    }
    node.update(changes)
    return {k: v for k, v in node.items() if v is not None}


def failed(code: str, msg: str, sub_code: str | None = None) -> dict[str, Any]:
    node = {"code": code, "msg": msg}
    if sub_code is not None:
        node |= {"sub_code": sub_code, "sub_msg": "..."}
    return node


def test_fund_change_y_with_this_refunds_amount_is_done() -> None:
    outcome = classify_refund(refunded(), PARAMS, KEY)
    assert isinstance(outcome, Accepted), outcome
    assert outcome.receipt.reference == f"{TRADE}:{KEY}"
    assert dict(outcome.receipt.params) == PARAMS


@pytest.mark.parametrize(
    ("node", "detail"),
    [
        # a repeat of a refund number already refunded: no money moved *this* call; it does
        # not say the refund was not made (it was, the first time)
        (refunded(fund_change="N", send_back_fee=None), "fund_change N"),
        (refunded(fund_change="N"), "fund_change N"),
        # done, but refund_fee is the trade's total: which amount this refund was is unproven
        (refunded(send_back_fee=None), "without this refund's amount"),
        (refunded(fund_change=None), "without fund_change"),
        (refunded(fund_change="maybe"), "without fund_change"),
    ],
)
def test_a_success_code_that_does_not_prove_this_refund_is_unknown(
    node: dict[str, Any], detail: str
) -> None:
    outcome = classify_refund(node, PARAMS, KEY)
    assert isinstance(outcome, Unknown), outcome  # never Refused, never NotExecuted
    assert detail in outcome.detail
    assert outcome.status == 200


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"send_back_fee": "100.01"}, "receipt_mismatch"),
        ({"out_trade_no": "A1043"}, "receipt_mismatch"),
        ({"send_back_fee": "1e2"}, "receipt_unreadable"),
        ({"trade_no": None}, "receipt_unreadable"),
        ({"trade_no": "2026<script>"}, "receipt_unreadable"),
        # Alipay's trade number is a non-empty string: an empty one or a number is not it
        ({"trade_no": ""}, "receipt_unreadable"),
        ({"trade_no": int(TRADE)}, "receipt_unreadable"),
    ],
)
def test_a_success_that_does_not_fit_the_intent_is_misuse(
    changes: dict[str, Any], code: str
) -> None:
    outcome = classify_refund(refunded(**changes), PARAMS, KEY)
    assert isinstance(outcome, Misuse) and outcome.code == code, outcome
    assert outcome.status == 200  # Alipay answers in the body: the HTTP status recorded


@pytest.mark.parametrize(
    ("node", "reason"),
    [
        (failed("40004", "Business Failed", "ACQ.SELLER_BALANCE_NOT_ENOUGH"), "business_rejected"),
        (failed("40004", "Business Failed", "ACQ.REFUND_AMT_NOT_EQUAL_TOTAL"), "business_rejected"),
        (failed("40004", "Business Failed", "ACQ.TRADE_NOT_EXIST"), "business_rejected"),
        (failed("40004", "Business Failed", "ACQ.TRADE_STATUS_ERROR"), "business_rejected"),
        (failed("40004", "Business Failed", "ACQ.TRADE_HAS_FINISHED"), "business_rejected"),
        (failed("40004", "Business Failed", "ACQ.REASON_TRADE_BEEN_FREEZEN"), "business_rejected"),
        (
            failed("40004", "Business Failed", "ACQ.REASON_TRADE_REFUND_FEE_ERR"),
            "business_rejected",
        ),
        (failed("40004", "Business Failed", "ACQ.TRADE_NOT_ALLOW_REFUND"), "business_rejected"),
        (failed("40004", "Business Failed", "ACQ.INVALID_PARAMETER"), "invalid_params"),
        (failed("40001", "Missing Required Arguments", "isv.missing-signature"), "invalid_params"),
        (failed("40002", "Invalid Arguments", "isv.invalid-parameter"), "invalid_params"),
        (failed("40002", "Invalid Arguments", "isv.invalid-signature"), "permission_denied"),
        (failed("40002", "Invalid Arguments", "isv.invalid-app-id"), "permission_denied"),
        (
            failed("20001", "Insufficient Token Permissions", "aop.invalid-auth-token"),
            "permission_denied",
        ),
        (
            failed("40006", "Insufficient Permissions", "isv.insufficient-isv-permissions"),
            "permission_denied",
        ),
    ],
)  # fmt: skip
def test_a_documented_refusal_is_refused_with_its_sub_code(
    node: dict[str, Any], reason: str
) -> None:
    outcome = classify_refund(node, PARAMS, KEY)
    assert isinstance(outcome, Refused), outcome
    assert outcome.reason is RejectReason(reason)
    assert outcome.code == node["sub_code"]
    assert outcome.status == 200  # Alipay answers in the body: the HTTP status recorded


@pytest.mark.parametrize(
    ("code", "reason"),
    [("20001", "permission_denied"), ("40006", "permission_denied"),
     ("40001", "invalid_params"), ("40002", "invalid_params")],
)  # fmt: skip
def test_a_refusal_without_a_sub_code_is_named_by_its_code(code: str, reason: str) -> None:
    outcome = classify_refund(failed(code, "..."), PARAMS, KEY)
    assert isinstance(outcome, Refused), outcome
    assert (outcome.reason, outcome.code, outcome.status) == (
        RejectReason(reason),
        f"code_{code}",
        200,
    )


@pytest.mark.parametrize(
    "node",
    [
        failed("20000", "Service Currently Unavailable", "isp.unknow-error"),
        failed("20000", "Service Currently Unavailable", "ISP.UNKNOW-ERROR"),
        failed("40004", "Business Failed", "ACQ.SYSTEM_ERROR"),
        # a sub-code Alipay does not document for refunds proves nothing
        failed("40004", "Business Failed", "ACQ.SOMETHING_NEW"),
        # a credential sub-code is our credentials' fault under 40002 only: under 40004 it is
        # not a documented refund refusal, and proves nothing was not done
        failed("40004", "Business Failed", "isv.invalid-signature"),
    ],
)
def test_an_answer_that_may_follow_processing_is_unknown(node: dict[str, Any]) -> None:
    assert isinstance(classify_refund(node, PARAMS, KEY), Unknown)


def test_the_refund_number_used_with_other_params_is_misuse() -> None:
    node = failed("40004", "Business Failed", "ACQ.DISCORDANT_REPEAT_REQUEST")
    outcome = classify_refund(node, PARAMS, KEY)
    assert isinstance(outcome, Misuse) and outcome.code == "idempotency_error", outcome
    assert outcome.status == 200


def test_an_undocumented_code_is_misuse() -> None:
    outcome = classify_refund({"code": "99999", "msg": "?"}, PARAMS, KEY)
    assert isinstance(outcome, Misuse) and outcome.code == "unexpected_response"
    assert outcome.status == 200
    # the person who looks is told which code came back, or that none did
    assert outcome.detail == "Alipay answered code 99999"
    without = classify_refund({"msg": "?"}, PARAMS, KEY)
    assert isinstance(without, Misuse) and without.detail == "Alipay answered code none"


def queried(**changes: Any) -> dict[str, Any]:
    node = {
        "code": "10000",
        "msg": "Success",
        "trade_no": TRADE,
        "out_trade_no": "A1042",
        "out_request_no": KEY,
        "total_amount": "150.00",
        "refund_amount": "100.00",
        "refund_status": "REFUND_SUCCESS",
    }
    node.update(changes)
    return {k: v for k, v in node.items() if v is not None}


def test_a_query_showing_refund_success_is_found() -> None:
    found = classify_query(queried(), PARAMS, KEY)
    assert isinstance(found, Found) and found.reason is None, found
    assert found.receipt.reference == f"{TRADE}:{KEY}"
    assert dict(found.receipt.params) == PARAMS


def test_an_empty_query_answer_is_not_found_never_not_executed() -> None:
    """Nothing shown (not received, failed, or still processing): a "not found" the
    reconciler trusts only past quiescence; never a refusal or a settled outcome."""
    empty = queried(refund_status=None, refund_amount=None, total_amount=None)
    assert isinstance(classify_query(empty, PARAMS, KEY), LookupNotFound)


def test_a_query_of_a_trade_that_does_not_exist_is_not_found() -> None:
    node = failed("40004", "Business Failed", "ACQ.TRADE_NOT_EXIST")
    assert isinstance(classify_query(node, PARAMS, KEY), LookupNotFound)
    # only as a business failure: the sub-code under an unavailable service proves nothing
    down = failed("20000", "Service Currently Unavailable", "ACQ.TRADE_NOT_EXIST")
    assert isinstance(classify_query(down, PARAMS, KEY), Unavailable)


@pytest.mark.parametrize(
    ("node", "detail"),
    [
        (failed("20000", "Service Currently Unavailable", "isp.unknow-error"),
         "the refund query answered 20000 isp.unknow-error"),
        ({"msg": "?"}, "the refund query answered no code"),
    ],
)  # fmt: skip
def test_an_unavailable_query_says_which_code_came_back(node: dict[str, Any], detail: str) -> None:
    looked = classify_query(node, PARAMS, KEY)
    assert isinstance(looked, Unavailable) and looked.detail == detail, looked


@pytest.mark.parametrize(
    "node",
    [
        failed("20000", "Service Currently Unavailable", "isp.unknow-error"),
        failed("40004", "Business Failed", "ACQ.SYSTEM_ERROR"),
        failed("40002", "Invalid Arguments", "isv.invalid-signature"),
        queried(refund_status=None),  # an amount without a status: not proof of either
        # a success without its amount: not readable, and never "not found"
        queried(refund_amount=None),
        queried(refund_status="REFUND_PROCESSING"),  # not a status Alipay documents
        queried(refund_amount="ten"),
        # no trade number: not a readable refund (as an unreadable amount), not misuse
        queried(trade_no=None),
        queried(trade_no=""),
    ],
)
def test_a_query_that_cannot_settle_it_is_unavailable(node: dict[str, Any]) -> None:
    looked = classify_query(node, PARAMS, KEY)
    assert isinstance(looked, Unavailable) and not looked.pending, looked


def test_a_query_showing_another_amount_is_misuse_with_what_alipay_did() -> None:
    looked = classify_query(queried(refund_amount="99.00"), PARAMS, KEY)
    assert isinstance(looked, LookupMisuse) and looked.code == "receipt_mismatch", looked
    assert looked.record is not None and looked.record.params["amount_minor"] == 9900


def test_a_query_echoing_another_refund_number_is_not_ours() -> None:
    looked = classify_query(queried(out_request_no="stl_other"), PARAMS, KEY)
    assert isinstance(looked, LookupMisuse) and looked.code == "receipt_key_mismatch"
    assert looked.record is None


@pytest.mark.parametrize(
    ("minor", "text"), [(10000, "100.00"), (1, "0.01"), (5, "0.05"), (123456, "1234.56")]
)
def test_amounts_are_yuan_with_two_decimals(minor: int, text: str) -> None:
    assert yuan(minor) == text
    assert fen(text) == minor


@pytest.mark.parametrize("text", ["", "1e2", "-1.00", "1.001", "01.00", " 1.00", 100])
def test_an_amount_that_is_not_yuan_is_not_read(text: object) -> None:
    assert fen(text) is None
