"""HttpGateway: every response and transport error classified per DESIGN.md, over MockTransport."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from outbox import wire
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
    Proof,
    Refused,
    SendPhase,
    Unavailable,
    Unknown,
)
from outbox.kinds import Kind, default_registry
from outbox.states import RejectReason
from settled.simulator.server import IDLE_TIMEOUT_SECONDS
from workers.http_client import KEEPALIVE_EXPIRY_SECONDS, HttpGateway

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
DEADLINE = NOW + timedelta(seconds=60)
API_KEY = "sk_live_very_secret_51Hx"
KEY = "stl_abc123"
OP_ID = "op-1"
REFUND = default_registry().get("refund")
PARAMS: dict[str, Any] = {
    "order_id": "A1042",
    "amount_minor": 10000,
    "currency": "CNY",
    "payee": "P7",
}

Handler = Callable[[httpx.Request], httpx.Response]


def receipt(
    params: Mapping[str, Any] = PARAMS, status: str = "succeeded", key: str = KEY
) -> dict[str, Any]:
    return {
        "id": "re_1",
        "object": "refund",
        "status": status,
        "params": dict(params),
        "idempotency_key": key,
    }


def error(status: int, type_: str, code: str, **headers: str) -> httpx.Response:
    body = {"error": {"type": type_, "code": code, "message": "m"}}
    return httpx.Response(status, json=body, headers=headers)


class Recorder:
    """A MockTransport handler that records what was sent."""

    def __init__(self, respond: Handler) -> None:
        self.respond = respond
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.respond(request)


def gateway(respond: Handler, *, timeout: float = 10.0, now: datetime = NOW) -> HttpGateway:
    return HttpGateway(
        "https://pay.example",
        {"acme": SecretStr(API_KEY)},
        timeout=timeout,
        transport=httpx.MockTransport(respond),
        clock=lambda: now,
    )


def submit(respond: Handler, kind: Kind = REFUND, **kw: Any) -> Any:
    with gateway(respond) as gw:
        return gw.submit(
            DownstreamRequest(kw.get("tenant", "acme"), OP_ID, kind, KEY, kw.get("params", PARAMS)),
            deadline=kw.get("deadline", DEADLINE),
        )


def lookup(respond: Handler, **kw: Any) -> Any:
    with gateway(respond) as gw:
        return gw.lookup(
            DownstreamRequest(kw.get("tenant", "acme"), OP_ID, REFUND, kw.get("key", KEY), PARAMS),
            deadline=kw.get("deadline", DEADLINE),
        )


# -- submit: status classification --------------------------------------------------------


def test_matching_receipt_is_accepted_as_done() -> None:
    outcome = submit(lambda r: httpx.Response(200, json=receipt()))
    assert isinstance(outcome, Accepted)
    assert outcome.proof is Proof.DONE
    assert outcome.receipt.reference == "re_1"
    assert outcome.receipt.params == PARAMS


def test_receipt_echoing_another_amount_is_misuse_not_success() -> None:
    outcome = submit(lambda r: httpx.Response(200, json=receipt({**PARAMS, "amount_minor": 1})))
    assert outcome == Misuse("receipt_mismatch", "the receipt does not match the intent", 200)


def test_receipt_missing_a_field_is_misuse() -> None:
    partial = {k: v for k, v in PARAMS.items() if k != "payee"}
    outcome = submit(lambda r: httpx.Response(200, json=receipt(partial)))
    assert isinstance(outcome, Misuse)
    assert outcome.code == "receipt_mismatch"


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        json.dumps({"id": "re_1"}).encode(),
        json.dumps(receipt(status="pending")).encode(),
    ],
    ids=["not-json", "not-object", "no-params", "not-succeeded"],
)
def test_2xx_without_a_readable_receipt_is_unknown(body: bytes) -> None:
    outcome = submit(lambda r: httpx.Response(200, content=body))
    assert isinstance(outcome, Unknown)
    assert outcome.status == 200


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (
            error(402, "business_error", "amount_exceeds_refundable"),
            Refused(RejectReason.BUSINESS_REJECTED, "amount_exceeds_refundable", 402),
        ),
        (
            error(400, "invalid_request", "invalid_params"),
            Refused(RejectReason.INVALID_PARAMS, "invalid_params", 400),
        ),
        (
            error(422, "invalid_request", "parameter_invalid"),
            Refused(RejectReason.INVALID_PARAMS, "parameter_invalid", 422),
        ),
        (
            error(401, "authentication_error", "invalid_api_key"),
            Refused(RejectReason.PERMISSION_DENIED, "invalid_api_key", 401),
        ),
        (httpx.Response(403), Refused(RejectReason.PERMISSION_DENIED, "http_403", 403)),
    ],
    ids=["business-402", "invalid-400", "invalid-422", "auth-401", "forbidden-403"],
)
def test_definite_refusals_are_not_done(response: httpx.Response, expected: Refused) -> None:
    outcome = submit(lambda r: response)
    assert outcome == expected
    assert outcome.proof is Proof.NOT_DONE


def test_429_is_not_executed_with_retry_after_seconds() -> None:
    outcome = submit(
        lambda r: error(429, "rate_limit_error", "rate_limited", **{"Retry-After": "7"})
    )
    assert outcome == NotExecuted(429, 7.0)


def test_429_retry_after_http_date_is_counted_from_the_injected_clock() -> None:
    date = "Sun, 01 Mar 2026 12:00:30 GMT"
    outcome = submit(
        lambda r: error(429, "rate_limit_error", "rate_limited", **{"Retry-After": date})
    )
    assert outcome == NotExecuted(429, 30.0)


def test_429_with_garbage_retry_after_has_no_retry_after() -> None:
    outcome = submit(lambda r: error(429, "rate_limit_error", "x", **{"Retry-After": "soon"}))
    assert outcome == NotExecuted(429, None)


def test_503_is_unknown_unless_the_contract_documents_it() -> None:
    respond: Handler = lambda r: error(503, "api_error", wire.NOT_PROCESSED)  # noqa: E731
    default = submit(respond)
    assert isinstance(default, Unknown)
    assert default.status == 503
    lenient = default_registry().with_contract(
        "refund", not_executed_statuses=frozenset({429, 503})
    )
    assert submit(respond, kind=lenient.get("refund")) == NotExecuted(503, None)


@pytest.mark.parametrize("status", [500, 502, 504, 599])
def test_other_5xx_are_unknown_never_a_refusal(status: int) -> None:
    outcome = submit(lambda r: error(status, "api_error", "internal_error"))
    assert isinstance(outcome, Unknown)
    assert outcome.status == status


@pytest.mark.parametrize("status", [400, 409, 422])
def test_same_key_with_other_params_is_misuse(status: int) -> None:
    outcome = submit(lambda r: error(status, "idempotency_error", wire.KEY_REUSED))
    assert isinstance(outcome, Misuse)
    assert outcome.code == "idempotency_error"
    assert outcome.status == status


def test_key_in_use_by_a_concurrent_request_is_unknown_not_misuse() -> None:
    outcome = submit(lambda r: error(409, "idempotency_error", wire.KEY_IN_USE))
    assert isinstance(outcome, Unknown)
    assert outcome.status == 409


def test_bare_409_is_unknown() -> None:
    assert isinstance(submit(lambda r: httpx.Response(409)), Unknown)


@pytest.mark.parametrize("status", [301, 404, 405, 418])
def test_status_outside_the_protocol_goes_to_a_person(status: int) -> None:
    outcome = submit(lambda r: httpx.Response(status, json={}))
    assert isinstance(outcome, Misuse)
    assert outcome.code == "unexpected_response"


FENCED = default_registry().with_contract("refund", enforces_deadline=True).get("refund")


def _late() -> httpx.Response:
    return error(wire.DEADLINE_EXCEEDED_STATUS, wire.DEADLINE_ERROR, wire.DEADLINE_EXCEEDED)


@pytest.mark.parametrize(
    ("kind", "respond", "expected"),
    [
        # the fence's answer, from a downstream whose contract declares the fence: not
        # executed, to be sent again (a new lease, a new deadline, the same key)
        (FENCED, _late, NotExecuted(408, None)),
        # the same answer where the contract declares no fence: a status the protocol does
        # not define for it, never trusted as "not executed"
        (REFUND, _late, Misuse("unexpected_response", "unexpected HTTP 408", 408)),
        # a 408 without the fence's body (a proxy's, say) proves nothing, fence or not
        (
            FENCED,
            lambda: httpx.Response(408, json={}),
            Misuse("unexpected_response", "unexpected HTTP 408", 408),
        ),
        (
            FENCED,
            lambda: error(408, wire.DEADLINE_ERROR, "something_else"),
            Misuse("unexpected_response", "unexpected HTTP 408", 408),
        ),
        # the fence's code on another status is no fence's answer either
        (FENCED, lambda: error(409, wire.DEADLINE_ERROR, wire.DEADLINE_EXCEEDED), Unknown),
    ],
    ids=["fenced", "not_declared", "bare_408", "other_code", "other_status"],
)
def test_the_deadline_fences_answer_is_not_executed_only_where_the_contract_declares_it(
    kind: Kind, respond: Callable[[], httpx.Response], expected: object
) -> None:
    outcome = submit(lambda r: respond(), kind=kind)
    if isinstance(expected, type):
        assert isinstance(outcome, expected)
    else:
        assert outcome == expected


# -- submit: transport errors split by phase ----------------------------------------------


def raising(exc: type[httpx.TransportError]) -> Handler:
    def respond(request: httpx.Request) -> httpx.Response:
        raise exc("boom", request=request)

    return respond


@pytest.mark.parametrize(
    ("exc", "phase"),
    [
        (httpx.ConnectError, SendPhase.CONNECT),
        (httpx.ConnectTimeout, SendPhase.CONNECT),
        (httpx.PoolTimeout, SendPhase.POOL),
    ],
)
def test_errors_before_any_byte_was_sent_are_not_sent(
    exc: type[httpx.TransportError], phase: SendPhase
) -> None:
    outcome = submit(raising(exc))
    assert outcome == NotSent(exc.__name__, phase)


@pytest.mark.parametrize(
    "exc",
    [
        httpx.ReadTimeout,
        httpx.WriteTimeout,
        httpx.ReadError,
        httpx.WriteError,
        httpx.RemoteProtocolError,
    ],
)
def test_errors_after_the_request_may_have_gone_out_are_unknown(
    exc: type[httpx.TransportError],
) -> None:
    outcome = submit(raising(exc))
    assert outcome == Unknown(exc.__name__)


# -- submit: what is sent, budget, tenants ------------------------------------------------


def test_request_carries_key_deadline_auth_and_params_on_the_kind_endpoint() -> None:
    recorder = Recorder(lambda r: httpx.Response(200, json=receipt()))
    submit(recorder)
    (request,) = recorder.requests
    assert request.method == "POST"
    assert request.url == "https://pay.example/v1/refunds"
    assert request.headers["Authorization"] == f"Bearer {API_KEY}"
    assert request.headers["Idempotency-Key"] == KEY
    # The downstream is told when this attempt's caller stops waiting: the deadline, or the
    # client's own timeout (10 s) when that comes first.
    told = wire.parse_deadline(request.headers["Settled-Deadline"])
    assert told is not None
    assert NOW + timedelta(seconds=10) <= told < NOW + timedelta(seconds=11)
    assert json.loads(request.content) == PARAMS


def test_the_deadline_header_is_the_callers_deadline_when_it_comes_first() -> None:
    recorder = Recorder(lambda r: httpx.Response(200, json=receipt()))
    submit(recorder, deadline=NOW + timedelta(seconds=5))
    assert recorder.requests[0].headers["Settled-Deadline"] == "2026-03-01T12:00:05.000Z"


@pytest.mark.parametrize(("configured", "left", "expected"), [(10.0, 60.0, 10.0), (10.0, 2.5, 2.5)])
def test_attempt_timeout_is_bounded_by_what_is_left_of_the_deadline(
    configured: float, left: float, expected: float
) -> None:
    recorder = Recorder(lambda r: httpx.Response(200, json=receipt()))
    with gateway(recorder, timeout=configured) as gw:
        gw.submit(
            DownstreamRequest("acme", OP_ID, REFUND, KEY, PARAMS),
            deadline=NOW + timedelta(seconds=left),
        )
    timeouts = recorder.requests[0].extensions["timeout"]
    for phase in ("connect", "read", "write", "pool"):
        assert expected - 1.0 < timeouts.get(phase) <= expected


@pytest.mark.parametrize("past", [timedelta(0), timedelta(seconds=5)])
def test_deadline_already_passed_sends_nothing(past: timedelta) -> None:
    recorder = Recorder(lambda r: httpx.Response(200, json=receipt()))
    outcome = submit(recorder, deadline=NOW - past)
    assert isinstance(outcome, NotSent)
    assert lookup(recorder, deadline=NOW - past) == Unavailable("deadline passed before sending")
    assert recorder.requests == []


def test_tenant_without_an_api_key_is_refused_without_sending() -> None:
    recorder = Recorder(lambda r: httpx.Response(200, json=receipt()))
    outcome = submit(recorder, tenant="globex")
    assert outcome == Refused(RejectReason.PERMISSION_DENIED, "no_api_key", 0)
    assert isinstance(lookup(recorder, tenant="globex"), Unavailable)
    assert recorder.requests == []


def test_non_positive_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="timeout"):
        HttpGateway("https://pay.example", {}, timeout=0)


def test_requests_carry_exactly_what_the_gateway_sets_and_no_cookies() -> None:
    recorder = Recorder(
        lambda r: httpx.Response(200, json=receipt(), headers={"Set-Cookie": "session=s1"})
    )
    with gateway(recorder) as gw:
        for _ in range(2):
            gw.submit(DownstreamRequest("acme", OP_ID, REFUND, KEY, PARAMS), deadline=DEADLINE)
    first, second = recorder.requests
    assert "Cookie" not in second.headers  # nothing learnt from one answer rides on the next
    assert set(first.headers) == {
        "host",
        "authorization",
        "settled-deadline",
        "idempotency-key",
        "content-type",
        "content-length",
    }
    assert first.headers["Content-Type"] == "application/json"
    assert first.content == json.dumps(PARAMS, separators=(",", ":")).encode()


def test_base_url_path_is_kept_in_front_of_every_endpoint() -> None:
    recorder = Recorder(lambda r: httpx.Response(200, json=receipt()))
    with HttpGateway(
        "https://pay.example/api/",
        {"acme": SecretStr(API_KEY)},
        transport=httpx.MockTransport(recorder),
        clock=lambda: NOW,
    ) as gw:
        gw.submit(DownstreamRequest("acme", OP_ID, REFUND, KEY, PARAMS), deadline=DEADLINE)
        gw.lookup(DownstreamRequest("acme", OP_ID, REFUND, "a/b", PARAMS), deadline=DEADLINE)
    assert [r.url.raw_path for r in recorder.requests] == [
        b"/api/v1/refunds",
        b"/api/v1/lookup/a%2Fb",
    ]


class _BrokenBody(httpx.SyncByteStream):
    """A response body that breaks off after its first bytes (the server went away)."""

    closed = False

    def __iter__(self) -> Iterator[bytes]:
        yield b'{"id": "re_1", '
        raise httpx.RemoteProtocolError("peer closed connection without sending complete body")

    def close(self) -> None:
        self.closed = True


def test_answer_cut_while_reading_its_body_is_unknown_and_the_connection_released() -> None:
    body = _BrokenBody()
    outcome = submit(lambda r: httpx.Response(200, stream=body))
    assert outcome == Unknown("RemoteProtocolError")
    assert body.closed
    lookup_body = _BrokenBody()
    assert lookup(lambda r: httpx.Response(200, stream=lookup_body)) == Unavailable(
        "RemoteProtocolError"
    )
    assert lookup_body.closed


def test_client_drops_idle_connections_before_the_simulator_does() -> None:
    # The relation that keeps a pooled connection from being reused as the server closes it.
    assert KEEPALIVE_EXPIRY_SECONDS * 2 <= IDLE_TIMEOUT_SECONDS


# -- lookup ---------------------------------------------------------------------------------


def test_lookup_found_with_matching_record() -> None:
    recorder = Recorder(lambda r: httpx.Response(200, json=receipt(key="stl_a/b c")))
    outcome = lookup(recorder, key="stl_a/b c")
    assert isinstance(outcome, Found)
    assert outcome.reason is None
    assert outcome.receipt.reference == "re_1"
    (request,) = recorder.requests
    assert request.method == "GET"
    assert request.url.raw_path == b"/v1/lookup/stl_a%2Fb%20c"
    assert request.headers["Authorization"] == f"Bearer {API_KEY}"
    assert "Settled-Deadline" in request.headers


def test_lookup_of_a_business_refusal_is_found_rejected_with_its_code() -> None:
    body = {
        **receipt(status="rejected"),
        "error": {"type": "business_error", "code": "order_closed"},
    }
    outcome = lookup(lambda r: httpx.Response(200, json=body))
    assert isinstance(outcome, Found)
    assert outcome.receipt.status == "rejected"
    assert (outcome.reason, outcome.code) == (RejectReason.BUSINESS_REJECTED, "order_closed")


def test_lookup_record_with_other_params_is_lookup_misuse() -> None:
    outcome = lookup(lambda r: httpx.Response(200, json=receipt({**PARAMS, "payee": "P8"})))
    assert isinstance(outcome, LookupMisuse)
    assert outcome.code == "receipt_mismatch"


def test_lookup_404_key_not_found_is_not_found() -> None:
    assert lookup(lambda r: error(404, "not_found", wire.KEY_NOT_FOUND)) == LookupNotFound()


@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(404, json={}),  # a missing route: no lookup API, proves nothing
        error(503, "api_error", "lookup_unavailable"),
        error(500, "api_error", "internal_error"),
        error(401, "authentication_error", "invalid_api_key"),
        httpx.Response(200, content=b"<html>"),
        httpx.Response(200, json=receipt(status="pending")),
    ],
    ids=["bare-404", "503", "500", "401", "not-json", "odd-status"],
)
def test_lookup_that_proves_nothing_is_unavailable(response: httpx.Response) -> None:
    assert isinstance(lookup(lambda r: response), Unavailable)


@pytest.mark.parametrize("exc", [httpx.ConnectError, httpx.ReadTimeout, httpx.RemoteProtocolError])
def test_lookup_transport_error_is_unavailable(exc: type[httpx.TransportError]) -> None:
    assert lookup(raising(exc)) == Unavailable(exc.__name__)


# -- secrets --------------------------------------------------------------------------------


def test_api_key_never_appears_in_logs_outcomes_or_gateway_repr(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    responses: list[Handler] = [
        lambda r: httpx.Response(200, json=receipt()),
        lambda r: error(401, "authentication_error", "invalid_api_key"),
        lambda r: error(400, "idempotency_error", wire.KEY_REUSED),
        lambda r: error(500, "api_error", "internal_error"),
        raising(httpx.ConnectError),
        raising(httpx.ReadTimeout),
    ]
    outcomes = [submit(respond) for respond in responses]
    outcomes += [lookup(respond) for respond in responses]
    with gateway(responses[0]) as gw:
        texts = [repr(gw), repr(vars(gw))]
    texts += [repr(o) for o in outcomes]
    assert caplog.records, "the gateway should log its calls"
    assert all(API_KEY not in text for text in [caplog.text, *texts])
    assert all(
        "P7" not in record.getMessage() and "10000" not in record.getMessage()
        for record in caplog.records
    ), "logs must not carry params or payees"


# -- what the downstream may not make us believe (issue: receipts bounded, keys compared) ---


@pytest.mark.parametrize(
    "reference",
    ["r" * 201, "re 1", "re_\u0663", "", "re_1\n", "-re"],
    ids=["too_long", "space", "unicode_digit", "empty", "newline", "leading_dash"],
)
def test_a_receipt_whose_reference_cannot_be_stored_is_misuse_not_done(reference: str) -> None:
    body = {**receipt(), "id": reference}
    outcome = submit(lambda r: httpx.Response(200, json=body))
    assert outcome == Misuse(
        "receipt_unreadable", "the receipt's reference is not a valid reference", 200
    )
    found = lookup(lambda r: httpx.Response(200, json=body))
    assert isinstance(found, LookupMisuse)
    assert found.code == "receipt_unreadable"


def test_a_reference_of_200_characters_is_accepted() -> None:
    body = {**receipt(), "id": "r" * 200}
    outcome = submit(lambda r: httpx.Response(200, json=body))
    assert isinstance(outcome, Accepted)
    assert outcome.receipt.reference == "r" * 200


def test_a_2xx_receipt_naming_another_idempotency_key_is_not_this_operations_receipt() -> None:
    outcome = submit(lambda r: httpx.Response(200, json=receipt(key="stl_someone_else")))
    assert isinstance(outcome, Misuse)
    assert outcome.code == "receipt_key_mismatch"
    found = lookup(lambda r: httpx.Response(200, json=receipt(key="stl_someone_else")))
    assert isinstance(found, LookupMisuse)
    assert found.code == "receipt_key_mismatch"


class FakeMonotonic:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_each_phase_gets_only_what_is_left_of_the_whole_attempt() -> None:
    mono = FakeMonotonic()
    seen: dict[str, float] = {}

    def respond(request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions["timeout"]
        seen["connect"] = timeouts.get("connect")
        mono.t += 3.0  # connecting took 3 s: the phases after it get what is left
        seen["write"] = timeouts.get("write")
        mono.t += 4.0
        seen["read"] = timeouts.get("read")
        return httpx.Response(200, json=receipt())

    deadline = Deadline(NOW + timedelta(seconds=8), mono.t + 8.0, mono)
    with gateway(respond) as gw:
        outcome = gw.submit(
            DownstreamRequest("acme", OP_ID, REFUND, KEY, PARAMS), deadline=deadline
        )
    assert isinstance(outcome, Accepted)
    assert seen == {"connect": 8.0, "write": 5.0, "read": 1.0}


def test_a_body_still_arriving_at_the_deadline_is_an_unknown_outcome() -> None:
    mono = FakeMonotonic()

    class Drip(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            body = json.dumps(receipt()).encode()
            for i in range(0, len(body), 10):
                mono.t += 1.0  # each piece takes a second
                yield body[i : i + 10]

    deadline = Deadline(NOW + timedelta(seconds=5), mono.t + 5.0, mono)
    with gateway(lambda r: httpx.Response(200, stream=Drip())) as gw:
        outcome = gw.submit(
            DownstreamRequest("acme", OP_ID, REFUND, KEY, PARAMS), deadline=deadline
        )
    assert outcome == Unknown("ReadTimeout")


def test_a_database_time_deadline_ignores_the_process_wall_clock() -> None:
    """A worker whose wall clock runs 15 s ahead of the database still sends (and is told the
    database-time deadline): deadlines are measured on the monotonic clock."""
    recorder = Recorder(lambda r: httpx.Response(200, json=receipt()))
    mono = FakeMonotonic()
    deadline = Deadline(NOW + timedelta(seconds=5), mono.t + 5.0, mono)
    with gateway(recorder, now=NOW + timedelta(seconds=15)) as gw:
        outcome = gw.submit(
            DownstreamRequest("acme", OP_ID, REFUND, KEY, PARAMS), deadline=deadline
        )
        found = gw.lookup(DownstreamRequest("acme", OP_ID, REFUND, KEY, PARAMS), deadline=deadline)
    assert isinstance(outcome, Accepted)
    assert isinstance(found, Found)
    assert [r.headers["Settled-Deadline"] for r in recorder.requests] == [
        "2026-03-01T12:00:05.000Z"
    ] * 2


def test_a_deadline_passed_on_the_monotonic_clock_sends_nothing() -> None:
    recorder = Recorder(lambda r: httpx.Response(200, json=receipt()))
    mono = FakeMonotonic()
    deadline = Deadline(NOW + timedelta(seconds=5), mono.t - 0.001, mono)
    with gateway(recorder) as gw:
        outcome = gw.submit(
            DownstreamRequest("acme", OP_ID, REFUND, KEY, PARAMS), deadline=deadline
        )
    assert isinstance(outcome, NotSent)
    assert recorder.requests == []
