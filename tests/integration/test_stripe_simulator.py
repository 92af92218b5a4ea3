"""The simulator's Stripe mode on the wire: form-encoded refunds, Stripe's error JSON,
``Idempotent-Replayed``, the refunds list with metadata and the 24-hour key retention on the
simulator's clock; all on the same ledger as the wire protocol."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from settled.simulator import SimulatorControl, SimulatorHandle
from tests.support.simtools import SimTenant

FORM = {
    "payment_intent": "pi_1",
    "amount": "2500",
    "metadata[settled_idempotency_key]": "k-1",
    "metadata[payee]": "P-7",
}


@pytest.fixture
def stripe_api(
    simulator: SimulatorHandle, sim_control: SimulatorControl, sim_tenant: SimTenant
) -> Iterator[httpx.Client]:
    sim_control.create_order("acme", "pi_1", 10000, currency="EUR")
    key = sim_tenant.api_key.get_secret_value()
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=simulator.url + "/stripe", headers=headers) as client:
        yield client


def _refund(api: httpx.Client, key: str = "k-1", **changes: str) -> httpx.Response:
    return api.post("/v1/refunds", data={**FORM, **changes}, headers={"Idempotency-Key": key})


def _error(response: httpx.Response) -> dict[str, Any]:
    error = response.json()["error"]
    assert set(error) <= {"type", "code", "message", "param"}
    return dict(error)


def test_a_refund_answers_stripes_refund_object_and_a_replay_says_so(
    stripe_api: httpx.Client, sim_control: SimulatorControl
) -> None:
    first = _refund(stripe_api)
    assert first.status_code == 200 and "Idempotent-Replayed" not in first.headers
    body = first.json()
    assert body["object"] == "refund" and body["id"].startswith("re_")
    assert (body["amount"], body["currency"], body["payment_intent"]) == (2500, "eur", "pi_1")
    assert body["metadata"] == {"settled_idempotency_key": "k-1", "payee": "P-7"}
    again = _refund(stripe_api)
    assert again.headers["Idempotent-Replayed"] == "true" and again.json() == body
    assert sim_control.effects("acme", "k-1") == 1
    assert sim_control.refunded("acme", "pi_1") == 2500


def test_the_same_key_with_other_params_is_an_idempotency_error(
    stripe_api: httpx.Client, sim_control: SimulatorControl
) -> None:
    _refund(stripe_api)
    other = _refund(stripe_api, amount="2600")
    assert other.status_code == 400 and _error(other)["type"] == "idempotency_error"
    assert sim_control.effects("acme", "k-1") == 1


def test_the_key_is_forgotten_after_24_hours_on_the_simulators_clock(
    stripe_api: httpx.Client, sim_control: SimulatorControl
) -> None:
    first = _refund(stripe_api)
    sim_control.advance_clock(23 * 3600)
    assert _refund(stripe_api).json()["id"] == first.json()["id"]
    sim_control.advance_clock(2 * 3600)
    later = _refund(stripe_api)
    assert later.status_code == 200 and later.json()["id"] != first.json()["id"]
    assert "Idempotent-Replayed" not in later.headers
    assert sim_control.effects("acme", "k-1") == 2  # why nothing may be re-sent past it


@pytest.mark.parametrize(
    ("changes", "status", "code", "param"),
    [
        ({"amount": "999999"}, 400, "amount_too_large", "amount"),
        ({"payment_intent": "pi_missing"}, 404, "resource_missing", "payment_intent"),
        ({"amount": "ten"}, 400, "parameter_invalid_integer", None),
    ],
    ids=["amount_too_large", "no_such_intent", "bad_amount"],
)
def test_refusals_answer_stripes_error_json_and_cause_nothing(
    stripe_api: httpx.Client,
    sim_control: SimulatorControl,
    changes: dict[str, str],
    status: int,
    code: str,
    param: str | None,
) -> None:
    answer = _refund(stripe_api, **changes)
    error = _error(answer)
    assert (answer.status_code, error["type"], error["code"]) == (
        status,
        "invalid_request_error",
        code,
    )
    assert error.get("param", param) == param
    assert sim_control.effects("acme", "k-1") == 0


def test_a_fully_refunded_intent_answers_charge_already_refunded(
    stripe_api: httpx.Client, sim_control: SimulatorControl
) -> None:
    sim_control.create_order("acme", "pi_1", 10000, currency="EUR", closed=True)
    error = _error(_refund(stripe_api))
    assert error["code"] == "charge_already_refunded"


def test_a_wrong_key_is_401_a_forbidden_one_403_and_a_rate_limit_429_in_stripes_shape(
    simulator: SimulatorHandle, stripe_api: httpx.Client, sim_control: SimulatorControl
) -> None:
    wrong = httpx.post(
        simulator.url + "/stripe/v1/refunds",
        data=FORM,
        headers={"Authorization": "Bearer sk_test_wrong", "Idempotency-Key": "k-1"},
    )
    assert wrong.status_code == 401 and _error(wrong)["type"] == "invalid_request_error"
    sim_control.add_rule("429", times=1, retry_after="3")
    limited = _refund(stripe_api)
    assert limited.status_code == 429 and _error(limited)["code"] == "rate_limit"
    assert limited.headers["Retry-After"] == "3"
    sim_control.add_rule("403", times=1)
    forbidden = _refund(stripe_api)
    assert forbidden.status_code == 403 and _error(forbidden)["type"] == "invalid_request_error"
    assert _error(forbidden)["code"] is None  # Stripe's permission error has no code
    assert _refund(stripe_api).status_code == 200  # nothing was saved for the key
    assert sim_control.effects("acme", "k-1") == 1


def test_the_list_shows_the_intents_refunds_with_metadata(
    stripe_api: httpx.Client, sim_control: SimulatorControl
) -> None:
    sim_control.create_order("acme", "pi_2", 10000, currency="EUR")
    _refund(stripe_api)
    _refund(stripe_api, key="k-2", payment_intent="pi_2")
    listed = stripe_api.get("/v1/refunds", params={"payment_intent": "pi_1"}).json()
    assert listed["object"] == "list" and listed["has_more"] is False
    assert [r["metadata"]["settled_idempotency_key"] for r in listed["data"]] == ["k-1"]
    sim_control.add_rule("lookup_unavailable", times=1)
    down = stripe_api.get("/v1/refunds", params={"payment_intent": "pi_1"})
    assert down.status_code == 503 and _error(down)["type"] == "api_error"


def test_a_list_is_a_lookup_of_each_key_it_could_show(
    stripe_api: httpx.Client, sim_control: SimulatorControl
) -> None:
    _refund(stripe_api)
    sim_control.add_rule("lookup_unavailable", "k-1")
    down = stripe_api.get("/v1/refunds", params={"payment_intent": "pi_1"})
    assert down.status_code == 503
    assert sim_control.requests("acme", "k-1", phase="lookup") == 1


def test_the_list_pages_like_stripe_newest_first(stripe_api: httpx.Client) -> None:
    created = [_refund(stripe_api, key=f"k-{i}", amount="10").json()["id"] for i in range(13)]
    newest_first = created[::-1]
    first = stripe_api.get("/v1/refunds", params={"payment_intent": "pi_1"}).json()
    assert [r["id"] for r in first["data"]] == newest_first[:10]  # Stripe's default limit
    assert first["has_more"] is True
    rest = stripe_api.get(
        "/v1/refunds",
        params={"payment_intent": "pi_1", "limit": 5, "starting_after": newest_first[9]},
    ).json()
    assert [r["id"] for r in rest["data"]] == newest_first[10:] and rest["has_more"] is False
    exact = stripe_api.get("/v1/refunds", params={"payment_intent": "pi_1", "limit": 13}).json()
    assert len(exact["data"]) == 13 and exact["has_more"] is False


@pytest.mark.parametrize(
    ("query", "param"),
    [({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"starting_after": "re_x"}, None)],
    ids=["limit_0", "limit_101", "unknown_starting_after"],
)
def test_a_bad_page_request_is_stripes_400(
    stripe_api: httpx.Client, query: dict[str, str], param: str | None
) -> None:
    _refund(stripe_api)
    answer = stripe_api.get("/v1/refunds", params={"payment_intent": "pi_1", **query})
    assert answer.status_code == 400 and _error(answer)["type"] == "invalid_request_error"
    assert _error(answer)["param"] == (param or "starting_after")
