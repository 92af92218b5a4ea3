"""The deadline fence's probe (docs/wire-protocol.md, "The fence's probe"): what its answer
proves (``classify_probe``: only ``408 deadline_exceeded`` verifies a fence) and what
``HttpGateway.probe_fence`` sends (a request no server executes), over MockTransport."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from outbox import wire
from outbox.kinds import default_registry
from workers.http_classify import FenceProbe, classify_probe, probe_unanswered
from workers.http_client import HttpGateway

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
API_KEY = "sk_live_very_secret_51Hx"
REGISTRY = default_registry()


def answer(status: int, type_: str | None = None, code: str | None = None) -> httpx.Response:
    if type_ is None:
        return httpx.Response(status)
    return httpx.Response(status, json={"error": {"type": type_, "code": code, "message": "m"}})


FENCE = answer(408, wire.DEADLINE_ERROR, wire.DEADLINE_EXCEEDED)

#: Every answer but the fence's own, and what the operator is told about it.
NOT_A_FENCE = {
    "200 receipt": (
        httpx.Response(200, json={"id": "re_1", "status": "succeeded", "params": {}}),
        "answered HTTP 200: it accepted a request past its deadline: it does not enforce the "
        "deadline",
    ),
    "201 empty": (
        httpx.Response(201),
        "answered HTTP 201: it accepted a request past its deadline: it does not enforce the "
        "deadline",
    ),
    "400 invalid_request": (
        answer(400, wire.INVALID_REQUEST, "invalid_params"),
        "answered HTTP 400 invalid_request invalid_params: it read a request past its deadline "
        "instead of refusing it: no fence",
    ),
    "422 invalid_request": (
        answer(422, wire.INVALID_REQUEST, "invalid_params"),
        "answered HTTP 422 invalid_request invalid_params: it read a request past its deadline "
        "instead of refusing it: no fence",
    ),
    "404 bare": (answer(404), "answered HTTP 404: no submit endpoint of the kind at this URL"),
    "405 bare": (answer(405), "answered HTTP 405: no submit endpoint of the kind at this URL"),
    "401": (
        answer(401, wire.AUTHENTICATION_ERROR, "invalid_api_key"),
        "answered HTTP 401 authentication_error invalid_api_key: the probe's API key was "
        "refused, so the fence could not be checked",
    ),
    "403": (
        answer(403, wire.PERMISSION_ERROR, "permission_denied"),
        "answered HTTP 403 permission_error permission_denied: the probe's API key was "
        "refused, so the fence could not be checked",
    ),
    "408 bare": (
        answer(408),
        "answered HTTP 408: a 408 without deadline_error / deadline_exceeded is not the "
        "fence's answer",
    ),
    "408 other code": (
        answer(408, wire.DEADLINE_ERROR, "too_slow"),
        "answered HTTP 408 deadline_error too_slow: a 408 without deadline_error / "
        "deadline_exceeded is not the fence's answer",
    ),
    "408 body not json": (
        httpx.Response(408, content=b"<html>timeout</html>"),
        "answered HTTP 408: a 408 without deadline_error / deadline_exceeded is not the "
        "fence's answer",
    ),
    "409 key in use": (
        answer(409, wire.IDEMPOTENCY_ERROR, wire.KEY_IN_USE),
        "answered HTTP 409 idempotency_error idempotency_key_in_use: not the fence's answer "
        "(408 deadline_exceeded)",
    ),
    "429": (
        answer(429, wire.RATE_LIMIT_ERROR, "rate_limited"),
        "answered HTTP 429 rate_limit_error rate_limited: not the fence's answer "
        "(408 deadline_exceeded)",
    ),
    "503 not_processed": (
        answer(503, wire.API_ERROR, wire.NOT_PROCESSED),
        "answered HTTP 503 api_error not_processed: not the fence's answer (408 deadline_exceeded)",
    ),
    "500": (
        answer(500),
        "answered HTTP 500: not the fence's answer (408 deadline_exceeded)",
    ),
    "302": (answer(302), "answered HTTP 302: not the fence's answer (408 deadline_exceeded)"),
}


def test_the_fences_own_answer_verifies_it() -> None:
    assert classify_probe(FENCE) == FenceProbe(
        True, "refused a request past its deadline: 408 deadline_exceeded"
    )


@pytest.mark.parametrize("name", NOT_A_FENCE)
def test_any_other_answer_verifies_nothing_and_says_what_came_back(name: str) -> None:
    response, detail = NOT_A_FENCE[name]
    assert classify_probe(response) == FenceProbe(False, detail)


def test_no_answer_verifies_nothing() -> None:
    assert probe_unanswered("ReadTimeout") == FenceProbe(
        False, "no answer (ReadTimeout): the fence could not be checked"
    )


# -- what the gateway sends ---------------------------------------------------------------


class Recorder:
    def __init__(self, response: httpx.Response | Exception) -> None:
        self.response = response
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if isinstance(self.response, Exception):
            raise self.response
        return self.response


def gateway(recorder: Recorder, keys: dict[str, SecretStr] | None = None) -> HttpGateway:
    return HttpGateway(
        "https://user:pw@pay.example/base",
        {"zeta": SecretStr("sk_other"), "acme": SecretStr(API_KEY)} if keys is None else keys,
        transport=httpx.MockTransport(recorder),
        clock=lambda: NOW,
    )


@pytest.mark.parametrize("name", REGISTRY.names())
def test_the_probe_is_a_late_submit_no_server_can_execute(name: str) -> None:
    kind = REGISTRY.get(name)
    recorder = Recorder(FENCE)
    with gateway(recorder) as gw:
        assert gw.probe_fence(kind).verified
        assert gw.probe_fence(kind).verified
    first, second = recorder.requests
    assert first.method == "POST"
    assert first.url.path == "/base" + kind.endpoint  # the kind's own submit endpoint
    headers = first.headers
    assert headers[wire.PROBE] == wire.PROBE_DEADLINE_FENCE
    deadline = wire.parse_deadline(headers[wire.DEADLINE])
    assert deadline is not None and deadline <= NOW - timedelta(hours=1)
    assert headers[wire.AUTHORIZATION] == f"Bearer {API_KEY}"  # the first tenant's, by name
    # A key of its own, fresh each time, never an operation's (those start with stl_).
    keys = [r.headers[wire.IDEMPOTENCY_KEY] for r in (first, second)]
    assert all(k.startswith(wire.PROBE_KEY_PREFIX) and not k.startswith("stl_") for k in keys)
    assert keys[0] != keys[1]
    body: Any = json.loads(first.content)
    assert body == wire.PROBE_BODY
    assert not set(body) & set(kind.intent.model_fields)  # none of the intent's fields


@pytest.mark.parametrize(
    "error",
    [
        httpx.ConnectError("refused"),
        httpx.ConnectTimeout("slow"),
        httpx.ReadTimeout("slow"),
        httpx.RemoteProtocolError("cut"),
    ],
    ids=type,
)
def test_a_probe_without_an_answer_verifies_nothing(error: Exception) -> None:
    with gateway(Recorder(error)) as gw:
        found = gw.probe_fence(REGISTRY.get("refund"))
    assert found == FenceProbe(
        False, f"no answer ({type(error).__name__}): the fence could not be checked"
    )


def test_a_success_answer_to_the_probe_verifies_nothing() -> None:
    with gateway(Recorder(httpx.Response(200, json={}))) as gw:
        assert not gw.probe_fence(REGISTRY.get("refund")).verified


def test_without_an_api_key_nothing_is_sent_and_nothing_verified() -> None:
    recorder = Recorder(FENCE)
    with gateway(recorder, keys={}) as gw:
        found = gw.probe_fence(REGISTRY.get("refund"))
    assert found == FenceProbe(
        False, "no API key configured (SETTLED_DOWNSTREAM_API_KEYS) to send the probe with"
    )
    assert recorder.requests == []


def test_the_endpoint_shown_has_no_user_or_password() -> None:
    with gateway(Recorder(FENCE)) as gw:
        shown = gw.endpoint_shown(REGISTRY.get("refund"))
    assert shown == "https://pay.example/base/v1/refunds"
