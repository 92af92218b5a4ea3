"""Stripe's rules one by one: ``workers.stripe_classify``'s pure functions called with the
SDK's error values and refund objects, each answer compared whole (its kind, reason, code,
detail and the HTTP status recorded), so a status, a fallback code or a boundary that moves is
seen. ``test_stripe_classification`` goes through the gateway and the SDK's error classes; this
file pins what it reads from them (docs/mutation.md: the survivors of ``stripe_classify.py``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
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
)
from outbox.states import RejectReason
from workers.stripe_classify import (
    answered,
    classify_error,
    classify_intent,
    classify_intent_error,
    classify_refund,
    error_of,
    intent_missing,
    receipt_of,
)

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
BUSINESS = RejectReason.BUSINESS_REJECTED
INVALID = RejectReason.INVALID_PARAMS
DENIED = RejectReason.PERMISSION_DENIED


def err(
    status: int | None,
    kind: str | None = None,
    code: str | None = None,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    cls: type[stripe.StripeError] = stripe.StripeError,
) -> stripe.StripeError:
    """The error the SDK raises for an answer of ``status`` with Stripe's error object (none
    where ``kind`` and ``code`` are both None)."""
    body: dict[str, Any] | None = None
    if kind is not None or code is not None:
        obj: dict[str, Any] = {"message": "documented example"}
        for name, value in (("type", kind), ("code", code), ("param", param)):
            if value is not None:
                obj[name] = value
        body = {"error": obj}
    return cls("documented example", http_status=status, json_body=body, headers=headers)


def connection_error(cause: BaseException | None) -> stripe.APIConnectionError:
    error = stripe.APIConnectionError("connection failed")
    error.__cause__ = cause
    return error


# -- a refund's create: classify_error ------------------------------------------------------

CREATE_ERRORS: list[tuple[str, stripe.StripeError, SubmitOutcome]] = [
    # nothing left the client / it may have
    (
        "connect-error",
        connection_error(httpx.ConnectError("refused")),
        NotSent("ConnectError", SendPhase.CONNECT),
    ),
    ("read-timeout", connection_error(httpx.ReadTimeout("no answer")), Unknown("ReadTimeout")),
    ("no-cause", connection_error(None), Unknown("connection error")),
    # 429 and Stripe's rate_limit code
    ("429", err(429), NotExecuted(429, None)),
    ("429-retry-after", err(429, headers={"Retry-After": "7"}), NotExecuted(429, 7.0)),
    ("429-other-code", err(429, "invalid_request_error", "amount_too_large"), NotExecuted(429)),
    ("400-rate-limit", err(400, "invalid_request_error", "rate_limit"), NotExecuted(429)),
    (
        "400-rate-limit-retry",
        err(400, None, "rate_limit", headers={"Retry-After": "3"}),
        NotExecuted(429, 3.0),
    ),
    ("403-rate-limit", err(403, None, "rate_limit"), Refused(DENIED, "rate_limit", 403)),
    (
        "500-rate-limit",
        err(500, "api_error", "rate_limit"),
        Unknown("server error rate_limit", 500),
    ),
    # our credentials
    ("401", err(401), Refused(DENIED, "http_401", 401)),
    ("403", err(403), Refused(DENIED, "http_403", 403)),
    (
        "401-code",
        err(401, "invalid_request_error", "api_key_expired"),
        Refused(DENIED, "api_key_expired", 401),
    ),
    ("403-idempotency", err(403, "idempotency_error", "x"), Refused(DENIED, "x", 403)),
    # the idempotency key
    (
        "409-idempotency",
        err(409, "idempotency_error"),
        Unknown("an earlier request with this key is still in flight", 409),
    ),
    (
        "409-idempotency-code",
        err(409, "idempotency_error", "idempotency_key_in_use"),
        Unknown("an earlier request with this key is still in flight", 409),
    ),
    (
        "400-idempotency",
        err(400, "idempotency_error"),
        Misuse("idempotency_error", "idempotency error", 400),
    ),
    (
        "400-idempotency-code",
        err(400, "idempotency_error", "idempotency_key_in_use"),
        Misuse("idempotency_error", "idempotency_key_in_use", 400),
    ),
    (
        "404-idempotency",
        err(404, "idempotency_error"),
        Misuse("idempotency_error", "idempotency error", 404),
    ),
    # other conflicts: Stripe may have processed it
    (
        "409-lock-timeout",
        err(409, "invalid_request_error", "lock_timeout"),
        Unknown("conflict lock_timeout", 409),
    ),
    ("409-bare", err(409), Unknown("conflict", 409)),
    # the card / the business
    ("402", err(402), Refused(BUSINESS, "card_error", 402)),
    ("402-code", err(402, "card_error", "card_declined"), Refused(BUSINESS, "card_declined", 402)),
    (
        "402-invalid-kind",
        err(402, "invalid_request_error", "parameter_missing"),
        Refused(BUSINESS, "parameter_missing", 402),
    ),
    ("400-card", err(400, "card_error", "expired_card"), Refused(BUSINESS, "expired_card", 400)),
    ("500-card", err(500, "card_error"), Refused(BUSINESS, "card_error", 500)),
    # invalid requests: the business's codes, or the caller's to fix
    (
        "400-business",
        err(400, "invalid_request_error", "charge_already_refunded"),
        Refused(BUSINESS, "charge_already_refunded", 400),
    ),
    (
        "404-business",
        err(404, "invalid_request_error", "amount_too_large"),
        Refused(BUSINESS, "amount_too_large", 404),
    ),
    (
        "400-invalid",
        err(400, "invalid_request_error", "parameter_missing"),
        Refused(INVALID, "parameter_missing", 400),
    ),
    (
        "404-missing",
        err(404, "invalid_request_error", "resource_missing"),
        Refused(INVALID, "resource_missing", 404),
    ),
    (
        "400-invalid-no-code",
        err(400, "invalid_request_error"),
        Refused(INVALID, "invalid_request", 400),
    ),
    (
        "422-invalid",
        err(422, "invalid_request_error", "parameter_missing"),
        Misuse("unexpected_response", "unexpected HTTP 422", 422),
    ),
    (
        "400-api-error",
        err(400, "api_error", "charge_already_refunded"),
        Misuse("unexpected_response", "unexpected HTTP 400", 400),
    ),
    ("404-bare", err(404), Misuse("unexpected_response", "unexpected HTTP 404", 404)),
    # the server: from 500 on, unknown
    ("500", err(500), Unknown("server error 500", 500)),
    ("503-code", err(503, "api_error", "overloaded"), Unknown("server error overloaded", 503)),
    (
        "500-invalid",
        err(500, "invalid_request_error", "amount_too_large"),
        Unknown("server error amount_too_large", 500),
    ),
    ("499", err(499), Misuse("unexpected_response", "unexpected HTTP 499", 499)),
    ("no-status", err(None), Misuse("unexpected_response", "unexpected HTTP 0", 0)),
    ("300", err(300), Misuse("unexpected_response", "unexpected HTTP 300", 300)),
]


@pytest.mark.parametrize(
    ("error", "outcome"), [case[1:] for case in CREATE_ERRORS], ids=[c[0] for c in CREATE_ERRORS]
)
def test_a_create_error_proves_exactly_this(
    error: stripe.StripeError, outcome: SubmitOutcome
) -> None:
    assert classify_error(error, now=NOW) == outcome


# -- the payment intent's read before the create: classify_intent_error ----------------------


def _unread(name: str) -> NotSent:
    return NotSent(f"the payment intent could not be read ({name}): not sent", SendPhase.BEFORE)


def _unread_http(status: int) -> NotSent:
    return NotSent(
        f"the payment intent could not be read (HTTP {status}): not sent", SendPhase.BEFORE
    )


INTENT_ERRORS: list[tuple[str, stripe.StripeError, SubmitOutcome]] = [
    (
        "connect-error",
        connection_error(httpx.ConnectError("refused")),
        NotSent("ConnectError", SendPhase.CONNECT),
    ),
    (
        "pool-timeout",
        connection_error(httpx.PoolTimeout("full")),
        NotSent("PoolTimeout", SendPhase.POOL),
    ),
    (
        "read-timeout",
        connection_error(httpx.ReadTimeout("no answer")),
        _unread("APIConnectionError"),
    ),
    ("no-cause", connection_error(None), _unread("APIConnectionError")),
    ("500", err(500), _unread("StripeError")),
    ("502-api", err(502, "api_error", cls=stripe.APIError), _unread("APIError")),
    ("499", err(499), _unread_http(499)),
    ("429", err(429), NotExecuted(429, None)),
    ("429-retry-after", err(429, headers={"Retry-After": "5"}), NotExecuted(429, 5.0)),
    ("400-rate-limit", err(400, "invalid_request_error", "rate_limit"), NotExecuted(429)),
    ("403-rate-limit", err(403, None, "rate_limit"), Refused(DENIED, "rate_limit", 403)),
    (
        "404-rate-limit",
        err(404, "invalid_request_error", "rate_limit"),
        Refused(INVALID, "rate_limit", 404),
    ),
    ("401", err(401), Refused(DENIED, "http_401", 401)),
    ("403", err(403), Refused(DENIED, "http_403", 403)),
    (
        "401-code",
        err(401, "invalid_request_error", "api_key_expired"),
        Refused(DENIED, "api_key_expired", 401),
    ),
    (
        "400-invalid",
        err(400, "invalid_request_error", "parameter_invalid_empty"),
        Refused(INVALID, "parameter_invalid_empty", 400),
    ),
    (
        "404-missing",
        err(404, "invalid_request_error", "resource_missing", param="payment_intent"),
        Refused(INVALID, "resource_missing", 404),
    ),
    ("404-no-code", err(404, "invalid_request_error"), Refused(INVALID, "invalid_request", 404)),
    ("400-api-error", err(400, "api_error", "x"), _unread_http(400)),
    ("422-invalid", err(422, "invalid_request_error", "x"), _unread_http(422)),
    ("402", err(402, "card_error", "card_declined"), _unread_http(402)),
    ("409", err(409, "idempotency_error"), _unread_http(409)),
    ("no-status", err(None), _unread_http(0)),
]


@pytest.mark.parametrize(
    ("error", "outcome"), [case[1:] for case in INTENT_ERRORS], ids=[c[0] for c in INTENT_ERRORS]
)
def test_an_intent_read_error_proves_exactly_this(
    error: stripe.StripeError, outcome: SubmitOutcome
) -> None:
    assert classify_intent_error(error, now=NOW) == outcome


# -- what the error object says: error_of, intent_missing ------------------------------------


@pytest.mark.parametrize(
    ("json_body", "sdk_code", "read"),
    [
        (
            {"error": {"type": "card_error", "code": "card_declined"}},
            None,
            ("card_error", "card_declined"),
        ),
        ({"error": {"type": 7, "code": ["x"]}}, "from_sdk", (None, None)),
        ({"error": "not an object"}, "from_sdk", (None, "from_sdk")),
        (None, "from_sdk", (None, "from_sdk")),
        ("a string", None, (None, None)),
    ],
    ids=["documented", "not-strings", "error-not-object", "no-body", "body-not-object"],
)
def test_the_error_object_is_read_only_where_it_has_the_documented_shape(
    json_body: Any, sdk_code: str | None, read: tuple[str | None, str | None]
) -> None:
    error = stripe.StripeError("m", http_status=400, json_body=json_body, code=sdk_code)
    assert error_of(error) == read


@pytest.mark.parametrize(
    ("error", "missing"),
    [
        (err(404, "invalid_request_error", "resource_missing", param="payment_intent"), True),
        (err(404, "invalid_request_error", "resource_missing", param="charge"), True),
        (err(400, "invalid_request_error", "resource_missing", param="payment_intent"), False),
        (err(403, "invalid_request_error", "resource_missing", param="payment_intent"), False),
        (err(405, "invalid_request_error", "resource_missing", param="payment_intent"), False),
        (err(404, "api_error", "resource_missing", param="payment_intent"), False),
        (err(404, "invalid_request_error", "parameter_missing", param="payment_intent"), False),
        (err(404, "invalid_request_error", "resource_missing", param="refund"), False),
        (err(404, "invalid_request_error", "resource_missing"), False),
    ],
    ids=[
        "intent",
        "charge",
        "400",
        "403",
        "405",
        "other-kind",
        "other-code",
        "other-param",
        "no-param",
    ],
)
def test_only_a_404_resource_missing_naming_the_intent_says_the_intent_is_missing(
    error: stripe.StripeError, missing: bool
) -> None:
    assert intent_missing(error) is missing


# -- a refund object: receipt_of, classify_refund --------------------------------------------

KEY = "stl_key_1"
INTENT = {"order_id": "pi_3Nx", "amount_minor": 1500, "currency": "EUR", "payee": "P-7"}


def refund(**changes: Any) -> dict[str, Any]:
    body = {
        "id": "re_3Nx1",
        "object": "refund",
        "amount": 1500,
        "currency": "eur",
        "payment_intent": "pi_3Nx",
        "status": "succeeded",
        "metadata": {"settled_idempotency_key": KEY, "payee": "P-7"},
    }
    return {**body, **changes}


@pytest.mark.parametrize(
    "changes",
    [
        {"id": 31},
        {"id": None},
        {"status": ["succeeded"]},
        {"status": None},
        {"amount": "1500"},
        {"amount": None},
        {"currency": 978},
        {"currency": None},
        {"status": "processing"},
    ],
    ids=[
        "id-number",
        "no-id",
        "status-list",
        "no-status",
        "amount-string",
        "no-amount",
        "currency-number",
        "no-currency",
        "status-undocumented",
    ],
)
def test_a_refund_of_an_undocumented_shape_is_no_receipt_and_an_unknown(
    changes: dict[str, Any],
) -> None:
    body = refund(**changes)
    assert receipt_of(body) is None
    assert classify_refund(body, INTENT, KEY) == Unknown("2xx without a readable refund", 200)


def test_a_refund_is_read_in_the_intents_names() -> None:
    body = refund(metadata=["not", "a", "mapping"])
    assert receipt_of(body) == Receipt(
        reference="re_3Nx1",
        status="succeeded",
        params={"order_id": "pi_3Nx", "amount_minor": 1500, "currency": "EUR", "payee": None},
        raw=body,
    )


def test_a_refund_of_a_charge_names_the_charge_as_its_order() -> None:
    body = refund(payment_intent=None, charge="ch_3Nx")
    receipt = receipt_of(body)
    assert receipt is not None and receipt.params["order_id"] == "ch_3Nx"


@pytest.mark.parametrize(
    ("changes", "outcome"),
    [
        (
            {"amount": 900},
            Misuse(
                "receipt_mismatch", "the refund does not fit the intent (receipt_mismatch)", 200
            ),
        ),
        ({"status": "pending"}, Unknown("the refund is pending at Stripe", 200)),
        ({"status": "requires_action"}, Unknown("the refund is requires_action at Stripe", 200)),
        ({"status": "failed"}, Refused(BUSINESS, "refund_failed", 200)),
        (
            {"status": "canceled", "failure_reason": "expired_or_canceled_card"},
            Refused(BUSINESS, "refund_canceled:expired_or_canceled_card", 200),
        ),
    ],
    ids=["misfit", "pending", "requires-action", "failed", "canceled"],
)
def test_a_refund_answered_to_a_create_proves_exactly_this(
    changes: dict[str, Any], outcome: SubmitOutcome
) -> None:
    assert classify_refund(refund(**changes), INTENT, KEY) == outcome


def test_a_refund_that_fits_is_accepted_with_its_receipt() -> None:
    body = refund()
    assert classify_refund(body, INTENT, KEY) == Accepted(receipt_of(body))  # type: ignore[arg-type]


# -- the intent read before the create: classify_intent --------------------------------------


@pytest.mark.parametrize(
    ("intent", "outcome"),
    [
        ({"id": "pi_3Nx", "currency": "eur"}, None),
        ({"id": "pi_3Nx", "currency": "usd"}, Refused(INVALID, "currency_mismatch", 200)),
        (
            {"id": "pi_other", "currency": "eur"},
            NotSent("the payment intent is not readable: not sent", SendPhase.BEFORE),
        ),
        (
            {"id": "pi_3Nx", "currency": None},
            NotSent("the payment intent is not readable: not sent", SendPhase.BEFORE),
        ),
        (
            {"id": "pi_3Nx"},
            NotSent("the payment intent is not readable: not sent", SendPhase.BEFORE),
        ),
    ],
    ids=["fits", "other-currency", "other-intent", "currency-null", "no-currency"],
)
def test_the_intent_read_decides_whether_the_refund_may_be_sent(
    intent: dict[str, Any], outcome: SubmitOutcome | None
) -> None:
    assert classify_intent(intent, INTENT) == outcome


# -- the answer's Request-Id: answered -------------------------------------------------------


def test_an_answers_request_id_is_kept_and_none_erases_nothing() -> None:
    unknown = Unknown("server error 500", 500)
    assert answered(unknown, "req_1") == Unknown("server error 500", 500, request_id="req_1")
    already = Unknown("server error 500", 500, request_id="req_0")
    assert answered(already, None) is already
    unsent = NotSent("ConnectError", SendPhase.CONNECT)
    assert answered(unsent, "req_1") is unsent


def test_only_a_connection_errors_cause_says_where_the_intent_read_stopped() -> None:
    # an answer with a status came back: whatever the SDK chained to it, the read reached
    # Stripe, so it did not stop at the connect
    answered_500 = err(500)
    answered_500.__cause__ = httpx.ConnectError("an earlier attempt's")
    assert classify_intent_error(answered_500, now=NOW) == _unread("StripeError")
    assert classify_error(answered_500, now=NOW) == Unknown("server error 500", 500)
