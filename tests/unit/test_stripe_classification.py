"""What each Stripe answer proves, read through the official SDK: a table of Stripe's
documented error objects (status and ``{"error": {...}}`` body) served by an in-memory
transport, each sent through ``StripeGateway`` and classified; connection errors by phase;
and the SDK's retries really off (one HTTP request per send, whatever the answer)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from outbox.clock import Deadline
from outbox.downstream import (
    Accepted,
    DownstreamRequest,
    Found,
    LookupMisuse,
    LookupNotFound,
    Misuse,
    NotExecuted,
    NotSent,
    Refused,
    Unavailable,
    Unknown,
)
from outbox.kinds import default_registry
from outbox.states import RejectReason
from tests.support.gateways import FakeMonotonic
from workers.stripe_gateway import API_VERSION, LIST_LIMIT, StripeGateway

REFUND = default_registry().get("refund")
INTENT = {"order_id": "pi_3Nx", "amount_minor": 1500, "currency": "EUR", "payee": "P-7"}
KEY = "stl_key_1"
OP_ID = "op-1"


def _error(type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"type": type_, "message": "documented example"}
    if code is not None:
        error["code"] = code
    if param is not None:
        error["param"] = param
    return {"error": error}


def _refund(**changes: Any) -> dict[str, Any]:
    refund = {
        "id": "re_3Nx1",
        "object": "refund",
        "amount": 1500,
        "currency": "eur",
        "payment_intent": "pi_3Nx",
        "status": "succeeded",
        "metadata": {
            "settled_tenant": "acme",
            "settled_op_id": OP_ID,
            "settled_idempotency_key": KEY,
            "payee": "P-7",
        },
    }
    return {**refund, **changes}


#: the payment intent the gateway reads before each create (``INTENT``'s, in its currency)
PAYMENT_INTENT = {"id": "pi_3Nx", "object": "payment_intent", "amount": 1500, "currency": "eur"}


class Served:
    """An in-memory Stripe: answers every request with one status and body, counting them;
    the payment intent read before a create (counted apart) answers ``PAYMENT_INTENT``."""

    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None):
        self.status, self.body, self.headers = status, body, headers or {}
        self.requests: list[httpx.Request] = []
        self.intent_reads: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path.startswith("/v1/payment_intents/"):
            self.intent_reads.append(request)
            return httpx.Response(200, json=PAYMENT_INTENT)
        self.requests.append(request)
        return httpx.Response(self.status, json=self.body, headers=self.headers)


def _gateway(handler: Callable[[httpx.Request], httpx.Response]) -> StripeGateway:
    return StripeGateway(
        {"acme": SecretStr("sk_test_abc")},
        api_base="http://stripe.test",
        transport=httpx.MockTransport(handler),
    )


def _submit(gateway: StripeGateway) -> Any:
    deadline = datetime.now(UTC) + timedelta(seconds=5)
    return gateway.submit(DownstreamRequest("acme", OP_ID, REFUND, KEY, INTENT), deadline=deadline)


def _lookup(gateway: StripeGateway) -> Any:
    deadline = datetime.now(UTC) + timedelta(seconds=5)
    return gateway.lookup(DownstreamRequest("acme", OP_ID, REFUND, KEY, INTENT), deadline=deadline)


# (status, body, headers) -> the outcome's type, and its reason and code where it refuses
TABLE: list[tuple[str, int, dict[str, Any], dict[str, str], type, Any, Any]] = [
    ("already_refunded", 400, _error("invalid_request_error", "charge_already_refunded"), {},
     Refused, RejectReason.BUSINESS_REJECTED, "charge_already_refunded"),
    ("amount_too_large", 400, _error("invalid_request_error", "amount_too_large", "amount"), {},
     Refused, RejectReason.BUSINESS_REJECTED, "amount_too_large"),
    ("bad_parameter", 400, _error("invalid_request_error", "parameter_invalid_integer", "amount"),
     {}, Refused, RejectReason.INVALID_PARAMS, "parameter_invalid_integer"),
    ("no_such_intent", 404, _error("invalid_request_error", "resource_missing", "payment_intent"),
     {}, Refused, RejectReason.INVALID_PARAMS, "resource_missing"),
    ("card_error", 402, _error("card_error", "card_declined"), {},
     Refused, RejectReason.BUSINESS_REJECTED, "card_declined"),
    ("authentication", 401, _error("invalid_request_error", "api_key_invalid"), {},
     Refused, RejectReason.PERMISSION_DENIED, "api_key_invalid"),
    ("permission", 403, _error("invalid_request_error", "secret_key_required"), {},
     Refused, RejectReason.PERMISSION_DENIED, "secret_key_required"),
    ("rate_limit", 429, _error("invalid_request_error", "rate_limit"), {"Retry-After": "7"},
     NotExecuted, None, None),
    ("lock_timeout", 429, _error("invalid_request_error", "lock_timeout"), {},
     NotExecuted, None, None),
    ("old_rate_limit", 400, _error("invalid_request_error", "rate_limit"), {},
     NotExecuted, None, None),
    ("idempotency_reused", 400, _error("idempotency_error"), {}, Misuse, None, None),
    ("idempotency_in_flight", 409, _error("idempotency_error"), {}, Unknown, None, None),
    ("api_error", 500, _error("api_error"), {}, Unknown, None, None),
    ("unavailable", 503, _error("api_error"), {"Stripe-Should-Retry": "true"},
     Unknown, None, None),
    ("redirect", 302, {}, {}, Misuse, None, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("status", "body", "headers", "outcome", "reason", "code"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_each_stripe_error_is_classified_by_what_it_proves(
    status: int,
    body: dict[str, Any],
    headers: dict[str, str],
    outcome: type,
    reason: RejectReason | None,
    code: str | None,
) -> None:
    served = Served(status, body, headers)
    gateway = _gateway(served)
    got = _submit(gateway)
    gateway.close()
    assert type(got) is outcome, got
    if isinstance(got, Refused):
        assert (got.reason, got.code, got.status) == (reason, code, status)
    if isinstance(got, NotExecuted) and "Retry-After" in headers:
        assert got.retry_after == 7.0
    assert len(served.requests) == 1  # the SDK's retries are off, whatever the answer


def test_a_refund_that_fits_the_intent_is_accepted_and_the_request_says_so() -> None:
    served = Served(200, _refund())
    gateway = _gateway(served)
    got = _submit(gateway)
    gateway.close()
    assert isinstance(got, Accepted) and got.receipt.reference == "re_3Nx1"
    (request,) = served.requests
    assert request.url.path == "/v1/refunds" and request.method == "POST"
    assert request.headers["Idempotency-Key"] == KEY
    assert request.headers["Stripe-Version"] == API_VERSION
    assert request.headers["Authorization"] == "Bearer sk_test_abc"
    form = dict(httpx.QueryParams(request.content.decode()))
    assert form == {
        "payment_intent": "pi_3Nx",
        "amount": "1500",
        "metadata[settled_tenant]": "acme",
        "metadata[settled_op_id]": OP_ID,
        "metadata[settled_idempotency_key]": KEY,
        "metadata[payee]": "P-7",
    }


@pytest.mark.parametrize(
    "changes",
    [{"amount": 1499}, {"currency": "usd"}, {"payment_intent": "pi_other"}],
    ids=["amount", "currency", "payment_intent"],
)
def test_a_refund_that_does_not_fit_the_intent_is_a_receipt_mismatch(
    changes: dict[str, Any],
) -> None:
    gateway = _gateway(Served(200, _refund(**changes)))
    got = _submit(gateway)
    assert isinstance(got, Misuse) and got.code == "receipt_mismatch"
    found = _gateway(
        Served(200, {"object": "list", "has_more": False, "data": [_refund(**changes)]})
    )
    looked = _lookup(found)
    assert isinstance(looked, LookupMisuse) and looked.code == "receipt_mismatch"
    assert looked.record is not None and looked.record.reference == "re_3Nx1"
    gateway.close()
    found.close()


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (httpx.ConnectError("refused"), NotSent),
        (httpx.ConnectTimeout("slow connect"), NotSent),
        (httpx.PoolTimeout("no connection"), NotSent),
        (httpx.ReadTimeout("no answer"), Unknown),
        (httpx.WriteError("broken pipe"), Unknown),
        (httpx.RemoteProtocolError("reset"), Unknown),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else value.__name__,
)
def test_connection_errors_are_split_by_phase_and_sent_once(
    error: httpx.TransportError, outcome: type
) -> None:
    calls: list[httpx.Request] = []

    def fail(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":  # the payment intent, read before the create
            return httpx.Response(200, json=PAYMENT_INTENT)
        calls.append(request)
        raise error

    gateway = _gateway(fail)
    got = _submit(gateway)
    gateway.close()
    assert type(got) is outcome, got
    assert len(calls) == 1  # no retry by the SDK, even for errors it would call retryable


def test_lookup_finds_the_refund_by_the_operation_in_its_metadata_without_sending_again() -> None:
    ours = _refund()["metadata"]
    others = [
        _refund(id="re_other_op", metadata={**ours, "settled_op_id": "op-2"}),
        _refund(id="re_other_tenant", metadata={**ours, "settled_tenant": "globex"}),
        _refund(id="re_no_metadata", metadata={}),
    ]
    served = Served(200, {"object": "list", "has_more": False, "data": [*others, _refund()]})
    gateway = _gateway(served)
    got = _lookup(gateway)
    gateway.close()
    assert isinstance(got, Found) and got.receipt.reference == "re_3Nx1"
    (request,) = served.requests
    assert request.method == "GET" and request.url.path == "/v1/refunds"
    assert request.url.params["payment_intent"] == "pi_3Nx"


def test_a_refund_of_the_operation_with_another_key_is_not_taken_as_ours() -> None:
    theirs = _refund(metadata={**_refund()["metadata"], "settled_idempotency_key": "stl_other"})
    gateway = _gateway(Served(200, {"object": "list", "has_more": False, "data": [theirs]}))
    got = _lookup(gateway)
    gateway.close()
    assert isinstance(got, LookupMisuse) and got.code == "receipt_key_mismatch"
    assert got.record is None  # not ours: nothing of it may settle the operation


@pytest.mark.parametrize(
    ("listed", "outcome"),
    [
        ({"object": "list", "has_more": False, "data": []}, LookupNotFound),
        ({"object": "list", "has_more": True, "data": []}, Unavailable),
        ({"object": "list", "has_more": False, "data": [_refund(status="failed")]}, Found),
    ],
    ids=["none", "has_more_without_a_page_to_follow", "failed_refund"],
)
def test_lookup_says_only_what_the_list_proves(listed: dict[str, Any], outcome: type) -> None:
    gateway = _gateway(Served(200, listed))
    got = _lookup(gateway)
    gateway.close()
    assert type(got) is outcome, got
    if isinstance(got, Found):
        assert got.reason is RejectReason.BUSINESS_REJECTED and got.code == "refund_failed"


class Paged:
    """An in-memory Stripe list of ``refunds`` (newest first), paged as Stripe pages it:
    ``limit``, ``starting_after``, ``has_more``; ``after_each`` runs after every page."""

    def __init__(self, refunds: list[dict[str, Any]], after_each: Callable[[], None] = list):
        self.refunds, self.after_each = refunds, after_each
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        limit = int(request.url.params["limit"])
        ids = [refund["id"] for refund in self.refunds]
        after = request.url.params.get("starting_after")
        rest = self.refunds[ids.index(after) + 1 :] if after is not None else self.refunds
        body = {"object": "list", "has_more": len(rest) > limit, "data": rest[:limit]}
        self.after_each()
        return httpx.Response(200, json=body)


def _others(n: int) -> list[dict[str, Any]]:
    """``n`` refunds of other operations on the same payment intent."""
    ours = _refund()["metadata"]
    return [
        _refund(id=f"re_other_{i}", metadata={**ours, "settled_op_id": f"op-other-{i}"})
        for i in range(n)
    ]


def test_lookup_reads_the_next_pages_until_it_finds_the_operation() -> None:
    paged = Paged([*_others(LIST_LIMIT + 50), _refund()])  # ours is the oldest
    gateway = _gateway(paged)
    got = _lookup(gateway)
    gateway.close()
    assert isinstance(got, Found) and got.receipt.reference == "re_3Nx1"
    first, second = paged.requests
    assert first.url.params["limit"] == str(LIST_LIMIT) and "starting_after" not in first.url.params
    assert second.url.params["starting_after"] == f"re_other_{LIST_LIMIT - 1}"


def test_an_operation_on_no_page_is_not_found_after_the_last_page() -> None:
    paged = Paged(_others(2 * LIST_LIMIT + 1))
    gateway = _gateway(paged)
    got = _lookup(gateway)
    gateway.close()
    assert isinstance(got, LookupNotFound)
    assert len(paged.requests) == 3


def test_a_deadline_passed_between_pages_is_unavailable_not_not_found() -> None:
    clock = FakeMonotonic()
    paged = Paged(_others(LIST_LIMIT + 1), after_each=lambda: clock.advance(10.0))
    gateway = _gateway(paged)
    deadline = Deadline(datetime.now(UTC) + timedelta(seconds=5), clock.t + 5.0, clock)
    request = DownstreamRequest("acme", OP_ID, REFUND, KEY, INTENT)
    got = gateway.lookup(request, deadline=deadline)
    gateway.close()
    assert isinstance(got, Unavailable) and "deadline" in got.detail
    assert len(paged.requests) == 1  # nothing more was asked once the deadline had passed


# a refund's status -> what a create answering it proves, and what a lookup finding it proves
STATUSES: list[tuple[str, type, type, str | None]] = [
    ("succeeded", Accepted, Found, None),
    ("pending", Unknown, Unavailable, None),  # taken on, not made: it may still fail
    ("requires_action", Unknown, Unavailable, None),
    ("failed", Refused, Found, "refund_failed"),  # not made, for good: not done
    ("canceled", Refused, Found, "refund_canceled"),
    ("something_new", Unknown, Unavailable, None),  # not read as proof of anything
]


@pytest.mark.parametrize(
    ("status", "created", "found", "code"), STATUSES, ids=[row[0] for row in STATUSES]
)
def test_a_refund_proves_what_its_status_says(
    status: str, created: type, found: type, code: str | None
) -> None:
    gateway = _gateway(Served(200, _refund(status=status)))
    sent = _submit(gateway)
    gateway.close()
    assert type(sent) is created, sent
    listed = _gateway(
        Served(200, {"object": "list", "has_more": False, "data": [_refund(status=status)]})
    )
    looked = _lookup(listed)
    listed.close()
    assert type(looked) is found, looked
    if isinstance(sent, Refused):
        assert (sent.reason, sent.code) == (RejectReason.BUSINESS_REJECTED, code)
    if isinstance(looked, Found) and code is not None:
        assert looked.receipt.status == "rejected"
        assert (looked.reason, looked.code) == (RejectReason.BUSINESS_REJECTED, code)


def test_a_pending_refund_that_does_not_fit_offers_no_record_to_settle_by() -> None:
    odd = _refund(status="pending", amount=1499)
    gateway = _gateway(Served(200, {"object": "list", "has_more": False, "data": [odd]}))
    looked = _lookup(gateway)
    gateway.close()
    assert isinstance(looked, LookupMisuse) and looked.code == "receipt_mismatch"
    assert looked.record is None  # a pending refund settles nothing, not even as it differs


def test_a_failing_list_is_unavailable_not_not_found() -> None:
    gateway = _gateway(Served(500, _error("api_error")))
    assert isinstance(_lookup(gateway), Unavailable)
    gateway.close()


def test_a_tenant_without_a_key_is_refused_locally_and_nothing_is_sent() -> None:
    served = Served(200, _refund())
    gateway = _gateway(served)
    deadline = datetime.now(UTC) + timedelta(seconds=5)
    got = gateway.submit(DownstreamRequest("other", OP_ID, REFUND, KEY, INTENT), deadline=deadline)
    gateway.close()
    assert isinstance(got, Refused) and got.reason is RejectReason.PERMISSION_DENIED
    assert served.requests == []


def test_the_secret_key_is_in_no_repr_of_the_gateway() -> None:
    gateway = _gateway(Served(200, _refund()))
    assert "sk_test_abc" not in repr(gateway) and "sk_test_abc" not in repr(vars(gateway))
    gateway.close()


# -- the payment intent, read before each create ------------------------------------------


class IntentServed:
    """An in-memory Stripe whose payment intent read answers ``status`` and ``body``; a create
    answers the intent's refund (counted in ``creates``)."""

    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None):
        self.status, self.body, self.headers = status, body, headers or {}
        self.creates: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(self.status, json=self.body, headers=self.headers)
        self.creates.append(request)
        return httpx.Response(200, json=_refund(), headers={"Request-Id": "req_create"})


# (status, body of the intent read) -> the outcome's type, and its reason and code if refused
INTENT_TABLE: list[tuple[str, int, dict[str, Any], type, Any, Any]] = [
    ("same_currency", 200, PAYMENT_INTENT, Accepted, None, None),
    ("currency_case", 200, {**PAYMENT_INTENT, "currency": "EUR"}, Accepted, None, None),
    ("other_currency", 200, {**PAYMENT_INTENT, "currency": "usd"},
     Refused, RejectReason.INVALID_PARAMS, "currency_mismatch"),
    ("no_currency", 200, {"id": "pi_3Nx", "object": "payment_intent"}, NotSent, None, None),
    ("another_intent", 200, {**PAYMENT_INTENT, "id": "pi_other"}, NotSent, None, None),
    ("no_such_intent", 404, _error("invalid_request_error", "resource_missing", "intent"),
     Refused, RejectReason.INVALID_PARAMS, "resource_missing"),
    ("authentication", 401, _error("invalid_request_error", "api_key_invalid"),
     Refused, RejectReason.PERMISSION_DENIED, "api_key_invalid"),
    ("restricted_key", 403, _error("invalid_request_error"),
     Refused, RejectReason.PERMISSION_DENIED, "http_403"),
    ("rate_limit", 429, _error("invalid_request_error", "rate_limit"), NotExecuted, None, None),
    ("api_error", 500, _error("api_error"), NotSent, None, None),
    ("unavailable", 503, _error("api_error"), NotSent, None, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("status", "body", "outcome", "reason", "code"),
    [row[1:] for row in INTENT_TABLE],
    ids=[row[0] for row in INTENT_TABLE],
)
def test_the_payment_intent_is_read_before_the_refund_and_decides_whether_it_is_sent(
    status: int, body: dict[str, Any], outcome: type, reason: RejectReason | None, code: Any
) -> None:
    served = IntentServed(status, body, {"Request-Id": "req_intent"})
    gateway = _gateway(served)
    got = _submit(gateway)
    gateway.close()
    assert type(got) is outcome, got
    assert len(served.creates) == (1 if outcome is Accepted else 0)  # never sent otherwise
    if isinstance(got, Refused):
        assert (got.reason, got.code) == (reason, code)
        assert got.request_id == "req_intent"  # the answer that refused it, for support
    if isinstance(got, Accepted):
        assert (got.status, got.request_id) == (200, "req_create")


def test_a_connection_error_reading_the_intent_is_not_sent_by_its_phase() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    gateway = _gateway(refuse)
    got = _submit(gateway)
    gateway.close()
    assert isinstance(got, NotSent) and got.phase.value == "connect", got


@pytest.mark.parametrize(
    ("status", "body", "outcome"),
    [
        (
            404,
            _error("invalid_request_error", "resource_missing", "payment_intent"),
            LookupNotFound,
        ),
        (404, _error("invalid_request_error", "resource_missing", "charge"), LookupNotFound),
        (404, _error("invalid_request_error", "resource_missing"), Unavailable),  # a route?
        (404, _error("invalid_request_error", "resource_missing", "starting_after"), Unavailable),
        (404, {}, Unavailable),
        (400, _error("invalid_request_error", "parameter_unknown", "payment_intent"), Unavailable),
    ],
    ids=["no_such_intent", "no_such_charge", "no_param", "other_param", "bare_404", "400"],
)
def test_only_stripes_404_for_the_payment_intent_is_a_lookups_not_found(
    status: int, body: dict[str, Any], outcome: type
) -> None:
    gateway = _gateway(Served(status, body))
    got = _lookup(gateway)
    gateway.close()
    assert type(got) is outcome, got


def test_a_create_answer_keeps_stripes_request_id() -> None:
    served = Served(500, _error("api_error"), {"Request-Id": "req_lost"})
    gateway = _gateway(served)
    got = _submit(gateway)
    gateway.close()
    assert isinstance(got, Unknown) and got.request_id == "req_lost"


@pytest.mark.parametrize(
    ("refund", "code"),
    [
        (
            _refund(status="failed", failure_reason="expired_or_canceled_card"),
            "refund_failed:expired_or_canceled_card",
        ),
        (
            _refund(status="failed", failure_reason="insufficient_funds"),
            "refund_failed:insufficient_funds",
        ),
        (_refund(status="failed"), "refund_failed"),
        (_refund(status="failed", failure_reason="Not <a> reason"), "refund_failed"),
        (_refund(status="canceled"), "refund_canceled"),
    ],
    ids=["expired_card", "insufficient_funds", "no_reason", "unreadable_reason", "canceled"],
)
def test_a_refund_not_made_is_refused_with_stripes_failure_reason(
    refund: dict[str, Any], code: str
) -> None:
    gateway = _gateway(Served(200, refund))
    made = _submit(gateway)
    found = _lookup(_gateway(Served(200, {"object": "list", "has_more": False, "data": [refund]})))
    gateway.close()
    assert isinstance(made, Refused) and made.code == code
    assert made.reason is RejectReason.BUSINESS_REJECTED
    assert isinstance(found, Found) and (found.reason, found.code) == (
        RejectReason.BUSINESS_REJECTED,
        code,
    )
