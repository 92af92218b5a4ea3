"""The wire classifiers at the edges their tables step over: a business refusal is one only
from a 4xx (a 5xx with a business body may have executed), a misuse answer keeps its code, a
WeChat Pay system error is unknown whatever its HTTP status. Each test here was written to kill
a mutant the mutation suite let through (docs/mutation.md)."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest

from outbox import wire
from outbox.downstream import (
    Accepted,
    Found,
    LookupMisuse,
    Misuse,
    NotExecuted,
    Refused,
    Unavailable,
    Unknown,
)
from outbox.kinds import default_registry
from outbox.states import RejectReason
from workers import wechatpay_classify
from workers.http_classify import FenceProbe, classify_lookup, classify_probe, classify_submit

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
REFUND = default_registry().get("refund")
PARAMS = {"order_id": "A1042", "amount_minor": 10000, "currency": "CNY", "payee": "P7"}


def _answer(status: int, type_: str, code: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"type": type_, "code": code, "message": "m"}})


def _classify(response: httpx.Response) -> object:
    return classify_submit(response, REFUND, PARAMS, now=NOW, idempotency_key="stl_k")


def test_a_business_body_on_a_server_error_is_unknown_not_a_refusal() -> None:
    got = _classify(_answer(500, wire.BUSINESS_ERROR, "insufficient_funds"))
    # the refund may have been made before the 500; staff read the downstream's code
    assert got == Unknown("server error insufficient_funds", 500)


@pytest.mark.parametrize("status", [399, 400, 499, 500])
def test_a_business_refusal_is_one_only_from_a_4xx(status: int) -> None:
    got = _classify(_answer(status, wire.BUSINESS_ERROR, "insufficient_funds"))
    refused = Refused(RejectReason.BUSINESS_REJECTED, "insufficient_funds", status)
    assert (got == refused) == (400 <= status < 500)
    assert not isinstance(got, Refused) or 400 <= status < 500


def test_an_idempotency_misuse_answer_keeps_its_code() -> None:
    got = _classify(_answer(400, wire.IDEMPOTENCY_ERROR, wire.KEY_REUSED))
    assert got == Misuse("idempotency_error", wire.KEY_REUSED, 400)


@pytest.mark.parametrize("status", [200, 400, 403])
def test_a_wechatpay_system_error_is_unknown_at_any_status(status: int) -> None:
    got = wechatpay_classify.classify_error(status, {"code": "SYSTEM_ERROR"}, {}, now=NOW)
    assert isinstance(got, Unknown)


@pytest.mark.parametrize("status", [400, 403, 429])
def test_a_wechatpay_frequency_limit_is_not_executed_at_any_status(status: int) -> None:
    got = wechatpay_classify.classify_error(status, {"code": "FREQUENCY_LIMITED"}, {}, now=NOW)
    assert isinstance(got, NotExecuted)


def _wechatpay(status: int, body: object) -> object:
    return wechatpay_classify.classify_error(status, body, {}, now=NOW)


def test_a_wechatpay_429_is_not_executed_whatever_its_body() -> None:
    assert _wechatpay(429, {}) == NotExecuted(429, None)
    assert _wechatpay(429, {"code": "SOMETHING_NEW"}) == NotExecuted(429, None)


@pytest.mark.parametrize(
    ("status", "body", "want"),
    [
        # a server error may have executed, with or without a code; the code is what staff read
        (500, {}, Unknown("WeChat Pay error 500", 500)),
        (502, {"message": "bad gateway"}, Unknown("WeChat Pay error 502", 502)),
        (500, {"code": "SYSTEM_ERROR"}, Unknown("WeChat Pay error SYSTEM_ERROR", 500)),
        (499, {}, Misuse("unexpected_response", "undocumented answer HTTP 499 ", 499)),
    ],
    ids=["500", "502", "SYSTEM_ERROR", "499"],
)
def test_a_wechatpay_server_error_is_unknown_from_500_and_says_what_came_back(
    status: int, body: object, want: object
) -> None:
    assert _wechatpay(status, body) == want


@pytest.mark.parametrize(
    ("status", "body", "code"),
    [
        (401, {}, "http_401"),
        # a code that is not a string is not WeChat Pay's code: named by the status
        (401, {"code": 7}, "http_401"),
        (403, {}, "http_403"),
        # a 403 refuses our standing whatever undocumented code it carries
        (403, {"code": "SOMETHING_NEW"}, "SOMETHING_NEW"),
    ],
    ids=["401", "401_code_not_a_string", "403", "403_undocumented"],
)
def test_a_wechatpay_401_or_403_without_a_documented_code_is_permission_denied(
    status: int, body: object, code: str
) -> None:
    assert _wechatpay(status, body) == Refused(RejectReason.PERMISSION_DENIED, code, status)


@pytest.mark.parametrize(
    ("status", "code", "want"),
    [
        (403, "INVALID_REQUEST", RejectReason.INVALID_PARAMS),
        (404, "RESOURCE_NOT_EXISTS", RejectReason.INVALID_PARAMS),
        # a caller's-error code at a status WeChat Pay does not document for it proves nothing
        (409, "PARAM_ERROR", None),
        (422, "INVALID_REQUEST", None),
    ],
)
def test_a_wechatpay_invalid_request_code_is_a_refusal_only_at_its_documented_statuses(
    status: int, code: str, want: RejectReason | None
) -> None:
    got = _wechatpay(status, {"code": code, "message": "m"})
    if want is None:
        detail = f"undocumented answer HTTP {status} {code}"  # what the person who looks reads
        assert got == Misuse("unexpected_response", detail, status)
    else:
        assert got == Refused(want, code, status)


WECHATPAY_REFUND = {
    "refund_id": "50000000382019052709732678859",
    "out_refund_no": "stl_k",
    "out_trade_no": "A1042",
    "status": "SUCCESS",
    "amount": {"total": 100000, "refund": 10000, "currency": "CNY"},
}


def test_the_wechatpay_refund_the_shapes_below_change_is_readable() -> None:
    got = wechatpay_classify.classify_refund(WECHATPAY_REFUND, PARAMS, "stl_k")
    assert isinstance(got, Accepted), got
    assert isinstance(
        wechatpay_classify.classify_lookup(200, WECHATPAY_REFUND, PARAMS, "stl_k"), Found
    )


@pytest.mark.parametrize(
    "refund",
    [
        [WECHATPAY_REFUND],  # not an object
        {k: v for k, v in WECHATPAY_REFUND.items() if k != "refund_id"},
        {**WECHATPAY_REFUND, "refund_id": 50000000382019052709732678859},
        {**WECHATPAY_REFUND, "status": ["SUCCESS"]},
        {**WECHATPAY_REFUND, "amount": 10000},
        {**WECHATPAY_REFUND, "amount": {"refund": "10000", "currency": "CNY"}},
        {**WECHATPAY_REFUND, "amount": {"refund": True, "currency": "CNY"}},
        {**WECHATPAY_REFUND, "amount": {"refund": 10000}},
    ],
    ids=["not_an_object", "no_refund_id", "refund_id_a_number", "status_a_list",
         "amount_a_number", "refund_a_string", "refund_a_bool", "no_currency"],
)  # fmt: skip
def test_a_wechatpay_refund_of_an_undocumented_shape_is_not_read(refund: object) -> None:
    """Not a refund: a 2xx carrying it proves nothing (unknown, looked up), a query answering
    it cannot settle it (unavailable); never misuse of a receipt, never an exception."""
    got = wechatpay_classify.classify_refund(refund, PARAMS, "stl_k")
    assert got == Unknown("2xx without a readable refund", 200)
    looked = wechatpay_classify.classify_lookup(200, refund, PARAMS, "stl_k")
    assert looked == Unavailable("the refund is not readable")


@pytest.mark.parametrize(
    ("refund", "want"),
    [
        ({**WECHATPAY_REFUND, "out_trade_no": "A9999"},
         Misuse("receipt_mismatch", "the refund does not fit the intent (receipt_mismatch)", 200)),
        ({**WECHATPAY_REFUND, "status": "PROCESSING"},
         Unknown("the refund is PROCESSING at WeChat Pay", 200)),
        ({**WECHATPAY_REFUND, "status": "CLOSED"},
         Refused(RejectReason.BUSINESS_REJECTED, "refund_closed", 200)),
    ],
    ids=["misfit", "processing", "closed"],
)  # fmt: skip
def test_a_wechatpay_refund_answer_records_its_http_status(refund: object, want: object) -> None:
    assert wechatpay_classify.classify_refund(refund, PARAMS, "stl_k") == want


@pytest.mark.parametrize(
    ("status", "body", "want"),
    [
        (199, WECHATPAY_REFUND, Unavailable("the query answered HTTP 199")),
        (200, WECHATPAY_REFUND, Found),
        (299, WECHATPAY_REFUND, Found),
        (300, WECHATPAY_REFUND, Unavailable("the query answered HTTP 300")),
        # a refund body on an error status is not an answer to read
        (500, WECHATPAY_REFUND, Unavailable("the query answered HTTP 500")),
        (500, {"code": "SYSTEM_ERROR"}, Unavailable("the query answered HTTP 500 SYSTEM_ERROR")),
        # "no such refund" only as a 404: the code on another status proves nothing
        (400, {"code": "RESOURCE_NOT_EXISTS"},
         Unavailable("the query answered HTTP 400 RESOURCE_NOT_EXISTS")),
    ],
    ids=["199", "200", "299", "300", "500_refund", "500_system_error", "400_not_exists"],
)  # fmt: skip
def test_a_wechatpay_query_is_read_only_from_a_2xx(status: int, body: object, want: object) -> None:
    got = wechatpay_classify.classify_lookup(status, body, PARAMS, "stl_k")
    if want is Found:
        assert isinstance(got, Found) and got.reason is None, got
    else:
        assert got == want


@pytest.mark.parametrize(
    ("refund", "code", "kept"),
    [
        # ours but different, and settled: what WeChat Pay did is kept for the person who looks
        ({**WECHATPAY_REFUND, "out_trade_no": "A9999"}, "receipt_mismatch", True),
        # not settled yet: nothing to keep
        ({**WECHATPAY_REFUND, "out_trade_no": "A9999", "status": "PROCESSING"},
         "receipt_mismatch", False),
        # another refund number: not ours, so not what was done with ours
        ({**WECHATPAY_REFUND, "out_refund_no": "stl_other"}, "receipt_key_mismatch", False),
    ],
    ids=["settled", "processing", "another_number"],
)  # fmt: skip
def test_a_wechatpay_query_unlike_the_intent_keeps_the_refund_only_if_ours_and_settled(
    refund: dict[str, object], code: str, kept: bool
) -> None:
    looked = wechatpay_classify.classify_lookup(200, refund, PARAMS, "stl_k")
    assert isinstance(looked, LookupMisuse) and looked.code == code, looked
    assert (looked.record is not None) is kept


RECEIPT_BODY = {"id": "re_1", "status": "succeeded", "params": PARAMS, "idempotency_key": "stl_k"}


@pytest.mark.parametrize(
    ("status", "accepted"), [(199, False), (200, True), (299, True), (300, False)]
)
def test_a_receipt_is_read_only_from_a_2xx(status: int, accepted: bool) -> None:
    got = _classify(httpx.Response(status, json=RECEIPT_BODY))
    if accepted:
        assert isinstance(got, Accepted) and got.status == status, got
    else:  # a receipt on a status the protocol does not define: a person looks
        assert got == Misuse("unexpected_response", f"unexpected HTTP {status}", status)


@pytest.mark.parametrize(
    ("status", "type_", "want"),
    [
        (400, wire.IDEMPOTENCY_ERROR, Misuse("idempotency_error", "idempotency error", 400)),
        (402, wire.BUSINESS_ERROR, Refused(RejectReason.BUSINESS_REJECTED, "business_error", 402)),
        (400, wire.INVALID_REQUEST, Refused(RejectReason.INVALID_PARAMS, "invalid_request", 400)),
        (422, wire.INVALID_REQUEST, Refused(RejectReason.INVALID_PARAMS, "invalid_request", 422)),
        (500, None, Unknown("server error 500", 500)),
    ],
    ids=["idempotency", "business", "invalid_400", "invalid_422", "server"],
)  # fmt: skip
def test_an_error_without_a_code_is_named_by_its_kind(
    status: int, type_: str | None, want: object
) -> None:
    body = {"error": {"type": type_, "message": "m"}} if type_ else {}
    assert _classify(httpx.Response(status, json=body)) == want


@pytest.mark.parametrize(
    ("status", "body"),
    [
        # an invalid-request refusal is one only from a 400 or 422; a 404 is a missing route
        (404, {"error": {"type": wire.INVALID_REQUEST, "code": "bad_amount"}}),
        # a 400 or a 499 whose body the protocol does not define: nobody can tell
        (400, {}),
        (400, {"error": {"type": "something_new", "code": "x"}}),
        (499, {}),
    ],
    ids=["404_invalid_request", "400_no_body", "400_unknown_type", "499_no_body"],
)
def test_an_undefined_4xx_answer_is_misuse_for_a_person(status: int, body: object) -> None:
    got = _classify(httpx.Response(status, json=body))
    assert got == Misuse("unexpected_response", f"unexpected HTTP {status}", status)


def _look(status: int, body: object) -> object:
    return classify_lookup(httpx.Response(status, json=body), PARAMS, idempotency_key="stl_k")


@pytest.mark.parametrize(
    ("status", "body", "want"),
    [
        # "no such key" only as a 404: the code on another status proves nothing
        (400, {"error": {"type": "invalid_request_error", "code": wire.KEY_NOT_FOUND}},
         Unavailable("lookup answered HTTP 400")),
        (500, {"error": {"type": "api_error", "code": wire.KEY_NOT_FOUND}},
         Unavailable("lookup answered HTTP 500")),
        # a record is read only from a 200
        (500, RECEIPT_BODY, Unavailable("lookup answered HTTP 500")),
        (201, RECEIPT_BODY, Unavailable("lookup answered HTTP 201")),
    ],
    ids=["400_key_not_found", "500_key_not_found", "500_record", "201_record"],
)  # fmt: skip
def test_a_lookup_is_read_only_from_a_200_or_a_404_key_not_found(
    status: int, body: object, want: object
) -> None:
    assert _look(status, body) == want


def test_a_lookup_record_unlike_the_intent_is_kept_only_when_it_is_ours() -> None:
    other = _look(200, {**RECEIPT_BODY, "params": {**PARAMS, "amount_minor": 1}})
    assert isinstance(other, LookupMisuse) and other.code == "receipt_mismatch", other
    assert other.record is not None and other.record.params["amount_minor"] == 1
    not_ours = _look(200, {**RECEIPT_BODY, "idempotency_key": "stl_other"})
    assert isinstance(not_ours, LookupMisuse) and not_ours.code == "receipt_key_mismatch"
    assert not_ours.record is None


def test_a_rejected_record_without_a_code_is_a_business_refusal() -> None:
    got = _look(200, {**RECEIPT_BODY, "status": "rejected"})
    assert isinstance(got, Found), got
    assert (got.reason, got.code) == (RejectReason.BUSINESS_REJECTED, "business_error")


@pytest.mark.parametrize(
    ("status", "why"),
    [
        (199, "not the fence's answer (408 deadline_exceeded)"),
        (200, "it accepted a request past its deadline: it does not enforce the deadline"),
        (299, "it accepted a request past its deadline: it does not enforce the deadline"),
        (300, "not the fence's answer (408 deadline_exceeded)"),
    ],
)
def test_the_fence_probe_reads_a_success_only_from_a_2xx(status: int, why: str) -> None:
    probe = classify_probe(httpx.Response(status, json=RECEIPT_BODY))
    assert probe == FenceProbe(False, f"answered HTTP {status}: {why}")


@pytest.mark.parametrize(
    "changes",
    [{"id": 31}, {"id": None}, {"params": None}, {"params": ["A1042", 10000]}, {"params": "A1042"}],
    ids=["id_number", "no_id", "no_params", "params_list", "params_string"],
)
def test_a_receipt_of_an_undefined_shape_is_no_receipt_on_a_submit_or_a_lookup(
    changes: dict[str, object],
) -> None:
    body = {**RECEIPT_BODY, **changes}
    # not a receipt that fails to fit (misuse, for a person): no receipt at all, which a
    # lookup may yet settle
    assert _classify(httpx.Response(200, json=body)) == Unknown(
        "2xx without a readable receipt", 200
    )
    assert _look(200, body) == Unavailable("lookup answered without a readable record")
