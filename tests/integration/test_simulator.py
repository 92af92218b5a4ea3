"""The simulator's own behaviour: Stripe-like idempotency, the commerce rules, switches, faults."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from outbox import wire
from settled.simulator import SimulatorControl, SimulatorHandle, Switches, start_in_thread
from settled.simulator.faults import Fault, Schedule
from tests.support import services
from tests.support.simtools import SimTenant

REFUND = {"order_id": "A1", "amount_minor": 4000, "currency": "CNY", "payee": "P1"}


class Client:
    """Raw HTTP against the simulator, to see statuses and headers exactly."""

    def __init__(self, url: str, api_key: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=5.0, trust_env=False)
        self.api_key = api_key

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def submit(
        self,
        key: str,
        params: Mapping[str, Any] = REFUND,
        path: str = "/v1/refunds",
        api_key: str | None = None,
        deadline: str = "2030-01-01T00:00:00.000Z",
    ) -> httpx.Response:
        headers = {
            "Authorization": f"Bearer {api_key or self.api_key}",
            "Idempotency-Key": key,
            "Settled-Deadline": deadline,
        }
        return self.http.post(path, json=dict(params), headers=headers)

    def lookup(self, key: str, api_key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {api_key or self.api_key}"}
        return self.http.get(f"/v1/lookup/{key}", headers=headers)


@pytest.fixture
def client(simulator: SimulatorHandle, sim_tenant: SimTenant) -> Iterator[Client]:
    c = Client(simulator.url, sim_tenant.api_key.get_secret_value())
    yield c
    c.http.close()


@pytest.fixture
def order(sim_control: SimulatorControl, sim_tenant: SimTenant) -> str:
    sim_control.create_order(sim_tenant.name, "A1", 10000, "CNY")
    return "A1"


def error_code(response: httpx.Response) -> str:
    return str(response.json()["error"]["code"])


# -- idempotency ----------------------------------------------------------------------------


@pytest.mark.usefixtures("order")
def test_replay_with_same_key_returns_first_result_without_a_second_refund(
    client: Client, sim_control: SimulatorControl
) -> None:
    first = client.submit("k1")
    second = client.submit("k1")
    assert first.status_code == 200
    assert wire.REPLAYED not in first.headers
    assert second.status_code == 200
    assert second.headers[wire.REPLAYED] == "true"
    assert second.json() == first.json()
    assert first.json()["params"] == REFUND
    assert first.json()["idempotency_key"] == "k1"
    assert sim_control.effects("acme", "k1") == 1
    assert sim_control.refunded("acme", "A1") == 4000


@pytest.mark.usefixtures("order")
def test_same_key_with_other_params_is_an_idempotency_error_and_changes_nothing(
    client: Client, sim_control: SimulatorControl
) -> None:
    client.submit("k1")
    other = client.submit("k1", {**REFUND, "amount_minor": 1})
    assert other.status_code == 400
    assert other.json()["error"]["type"] == wire.IDEMPOTENCY_ERROR
    assert error_code(other) == wire.KEY_REUSED
    other_path = client.submit(
        "k1", {"ticket_id": "T1", "order_id": "A1", "reason": "other"}, path="/v1/tickets"
    )
    assert error_code(other_path) == wire.KEY_REUSED
    assert sim_control.refunded("acme", "A1") == 4000


@pytest.mark.usefixtures("order")
def test_keys_are_scoped_per_tenant(client: Client, sim_control: SimulatorControl) -> None:
    sim_control.add_tenant("globex", "sk_test_globex")
    sim_control.create_order("globex", "A1", 10000, "CNY")
    assert client.submit("k1").status_code == 200
    theirs = client.submit("k1", api_key="sk_test_globex")
    assert theirs.status_code == 200
    assert wire.REPLAYED not in theirs.headers
    assert sim_control.effects("acme", "k1") == 1
    assert sim_control.effects("globex", "k1") == 1


@pytest.mark.usefixtures("order")
def test_concurrent_request_with_a_key_in_flight_gets_409_and_executes_nothing(
    client: Client, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule(Fault.HOLD_BEFORE_COMMIT, "k1", times=1, hold_seconds=10)
    results: list[httpx.Response] = []
    first = threading.Thread(target=lambda: results.append(client.submit("k1")))
    first.start()
    try:
        sim_control.wait_in_flight("acme", "k1")
        concurrent = client.submit("k1")
        assert concurrent.status_code == 409
        assert error_code(concurrent) == wire.KEY_IN_USE
        assert sim_control.effects("acme", "k1") == 0
    finally:
        sim_control.release_holds()
        first.join()
    assert results[0].status_code == 200
    assert sim_control.effects("acme", "k1") == 1
    assert not sim_control.in_flight("acme", "k1")


@pytest.mark.usefixtures("order")
def test_429_comes_before_the_idempotency_layer_and_saves_nothing(
    client: Client, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule(Fault.RATE_LIMITED, "k1", times=1, retry_after="3")
    limited = client.submit("k1")
    assert limited.status_code == 429
    assert limited.headers["Retry-After"] == "3"
    # Nothing was saved: the same key with other params is a fresh request, not a conflict.
    fresh = client.submit("k1", {**REFUND, "amount_minor": 1000})
    assert fresh.status_code == 200
    assert wire.REPLAYED not in fresh.headers
    assert sim_control.refunded("acme", "A1") == 1000


@pytest.mark.usefixtures("order")
def test_503_before_processing_saves_nothing(client: Client, sim_control: SimulatorControl) -> None:
    sim_control.add_rule(Fault.UNAVAILABLE_BEFORE, "k1", times=1)
    refused = client.submit("k1")
    assert refused.status_code == 503
    assert error_code(refused) == wire.NOT_PROCESSED
    assert client.lookup("k1").status_code == 404
    assert sim_control.effects("acme", "k1") == 0
    assert client.submit("k1").status_code == 200
    assert sim_control.effects("acme", "k1") == 1


@pytest.mark.usefixtures("order")
def test_503_after_commit_is_saved_and_replayed_while_the_refund_exists(
    client: Client, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule(Fault.UNAVAILABLE_AFTER_COMMIT, "k1", times=1)
    assert client.submit("k1").status_code == 503
    replay = client.submit("k1")
    assert replay.status_code == 503
    assert replay.headers[wire.REPLAYED] == "true"
    assert sim_control.effects("acme", "k1") == 1
    found = client.lookup("k1")
    assert found.status_code == 200
    assert found.json()["status"] == "succeeded"


@pytest.mark.usefixtures("order")
def test_invalid_params_are_refused_and_save_nothing(
    client: Client, sim_control: SimulatorControl
) -> None:
    invalid = client.submit("k1", {**REFUND, "currency": "cny"})
    assert invalid.status_code == 400
    assert invalid.json()["error"]["type"] == wire.INVALID_REQUEST
    assert client.submit("k1").status_code == 200
    assert sim_control.effects("acme", "k1") == 1


NESTED = [b"[" * 30000 + b"]" * 30000, b'{"a":' * 10000 + b"1" + b"}" * 10000]  # < 64 KiB


@pytest.mark.usefixtures("order")
@pytest.mark.parametrize("body", NESTED, ids=["array", "object"])
def test_a_deeply_nested_body_is_a_400_and_burns_no_key(
    client: Client, sim_control: SimulatorControl, body: bytes
) -> None:
    headers = {
        "Authorization": f"Bearer {client.api_key}",
        "Idempotency-Key": "k1",
        "Content-Type": "application/json",
    }
    response = client.http.post("/v1/refunds", content=body, headers=headers)
    assert response.status_code == 400  # it used to close the connection without an answer
    assert response.json()["error"]["type"] == wire.INVALID_REQUEST
    assert error_code(response) == "body_not_json"
    assert sim_control.effects("acme", "k1") == 0
    assert client.submit("k1").status_code == 200  # the key was not saved with the refusal
    assert sim_control.effects("acme", "k1") == 1


@pytest.mark.parametrize("route", ["rules", "tenants", "orders", "switches", "schedule"])
@pytest.mark.parametrize(
    "body",
    [*NESTED, b"\xff\xfe", b'{"tenant": "\\ud800", "api_key": "\\ud800", "order_id": "\\ud800"}'],
    ids=["nested-array", "nested-object", "not-utf8", "lone-surrogates"],
)
def test_a_control_body_the_simulator_cannot_read_is_a_400(
    simulator: SimulatorHandle, sim_control: SimulatorControl, route: str, body: bytes
) -> None:
    response = httpx.post(f"{simulator.url}/_control/{route}", content=body, trust_env=False)
    assert response.status_code == 400
    assert error_code(response) == "bad_control_request"
    assert sim_control.switches() == Switches()
    assert sim_control.ledger()["orders"] == []


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("orders", {"tenant": "acme", "order_id": "A1", "currency": "CNY", "amount_minor": 10**30}),
        ("clock", {"advance_seconds": 10**400}),
        ("schedule", {"seed": 1, "probabilities": {"reset_before": 10**400}}),
    ],
    ids=["order-amount", "clock", "probability"],
)
def test_a_control_number_too_large_is_a_400(
    simulator: SimulatorHandle, sim_control: SimulatorControl, route: str, body: dict[str, Any]
) -> None:
    response = httpx.post(f"{simulator.url}/_control/{route}", json=body, trust_env=False)
    assert response.status_code == 400
    assert error_code(response) == "bad_control_request"
    assert sim_control.ledger()["orders"] == []
    assert sim_control.faults()["schedule"] is None


def test_missing_idempotency_key_is_an_invalid_request(client: Client) -> None:
    response = client.http.post(
        "/v1/refunds", json=REFUND, headers={"Authorization": f"Bearer {client.api_key}"}
    )
    assert response.status_code == 400
    assert error_code(response) == "idempotency_key_missing"


# -- switches and clock ---------------------------------------------------------------------


@pytest.mark.usefixtures("order")
def test_keys_past_retention_are_forgotten_and_a_replay_executes_again(
    client: Client, sim_control: SimulatorControl
) -> None:
    sim_control.set_switches(key_retention_seconds=60)
    assert client.submit("k1").status_code == 200
    sim_control.advance_clock(61)
    assert error_code(client.lookup("k1")) == wire.KEY_NOT_FOUND
    again = client.submit("k1")
    assert again.status_code == 200
    assert wire.REPLAYED not in again.headers
    assert sim_control.effects("acme", "k1") == 2
    assert sim_control.refunded("acme", "A1") == 8000


@pytest.mark.usefixtures("order")
def test_lookup_hides_a_result_until_the_visibility_delay_passed(
    client: Client, sim_control: SimulatorControl
) -> None:
    sim_control.set_switches(lookup_visibility_delay=30)
    receipt = client.submit("k1").json()
    hidden = client.lookup("k1")
    assert hidden.status_code == 404
    assert error_code(hidden) == wire.KEY_NOT_FOUND
    sim_control.advance_clock(31)
    visible = client.lookup("k1")
    assert visible.status_code == 200
    assert visible.json()["id"] == receipt["id"]


@pytest.mark.usefixtures("order")
def test_idempotency_off_executes_every_request_anew(
    client: Client, sim_control: SimulatorControl
) -> None:
    sim_control.set_switches(idempotency=False)
    first, second = client.submit("k1"), client.submit("k1")
    assert first.json()["id"] != second.json()["id"]
    assert sim_control.effects("acme", "k1") == 2


@pytest.mark.usefixtures("order")
def test_lookup_off_answers_a_bare_404_not_key_not_found(
    client: Client, sim_control: SimulatorControl
) -> None:
    client.submit("k1")
    switches = sim_control.set_switches(lookup=False)
    assert switches.lookup is False
    response = client.lookup("k1")
    assert response.status_code == 404
    assert "error" not in response.json()


# -- the deadline fence: a submit that arrives after its Settled-Deadline -------------------


def in_a_minute(sim_control: SimulatorControl) -> str:
    """A deadline 60 s ahead of the simulator's clock, as the header carries it."""
    now = sim_control.ledger()["now"]
    return wire.format_deadline(datetime.fromtimestamp(now + 60, UTC))


def assert_untouched(client: Client, sim_control: SimulatorControl, key: str) -> None:
    """Nothing of ``key`` anywhere: no effect, no refund, the key not marked."""
    assert sim_control.effects("acme", key) == 0
    assert sim_control.refunded("acme", "A1") == 0
    assert not sim_control.in_flight("acme", key)
    assert error_code(client.lookup(key)) == wire.KEY_NOT_FOUND


@pytest.mark.usefixtures("order")
def test_a_submit_arriving_after_its_deadline_is_refused_before_any_effect(
    client: Client, sim_control: SimulatorControl
) -> None:
    deadline = in_a_minute(sim_control)
    sim_control.advance_clock(61)  # the request arrives a second after its deadline
    late = client.submit("k1", deadline=deadline)
    assert late.status_code == wire.DEADLINE_EXCEEDED_STATUS == 408
    assert late.json()["error"]["type"] == wire.DEADLINE_ERROR
    assert error_code(late) == wire.DEADLINE_EXCEEDED
    assert wire.REPLAYED not in late.headers
    assert_untouched(client, sim_control, "k1")
    # The key was never marked: the next attempt, on time and with the same key, executes,
    # and executes once.
    timely = client.submit("k1", deadline=in_a_minute(sim_control))
    assert timely.status_code == 200 and wire.REPLAYED not in timely.headers
    assert client.submit("k1").headers[wire.REPLAYED] == "true"
    assert sim_control.effects("acme", "k1") == 1
    assert sim_control.refunded("acme", "A1") == 4000


@pytest.mark.usefixtures("order")
def test_a_submit_arriving_just_before_its_deadline_executes(
    client: Client, sim_control: SimulatorControl
) -> None:
    deadline = in_a_minute(sim_control)
    sim_control.advance_clock(58)  # 2 s to spare, however slow this machine is
    assert client.submit("k1", deadline=deadline).status_code == 200
    assert sim_control.effects("acme", "k1") == 1


@pytest.mark.usefixtures("order")
def test_a_late_replay_of_an_executed_key_still_returns_its_first_result(
    client: Client, sim_control: SimulatorControl
) -> None:
    """The fence stops new effects; a replay does nothing new and proves what was done."""
    first = client.submit("k1", deadline=in_a_minute(sim_control))
    sim_control.advance_clock(3600)
    replay = client.submit("k1", deadline="2000-01-01T00:00:00.000Z")
    assert replay.status_code == 200 and replay.headers[wire.REPLAYED] == "true"
    assert replay.json()["id"] == first.json()["id"]
    assert sim_control.effects("acme", "k1") == 1


@pytest.mark.usefixtures("order")
def test_a_late_submit_is_refused_with_idempotency_off_too(
    client: Client, sim_control: SimulatorControl
) -> None:
    sim_control.set_switches(idempotency=False)
    late = client.submit("k1", deadline="2000-01-01T00:00:00.000Z")
    assert error_code(late) == wire.DEADLINE_EXCEEDED
    assert sim_control.effects("acme", "k1") == 0


@pytest.mark.usefixtures("order")
def test_with_the_deadline_fence_off_a_late_submit_executes(
    client: Client, sim_control: SimulatorControl
) -> None:
    """A downstream without the fence, as Stripe is: the late request lands."""
    switches = sim_control.set_switches(deadline_fence=False)
    assert switches.deadline_fence is False
    late = client.submit("k1", deadline="2000-01-01T00:00:00.000Z")
    assert late.status_code == 200
    assert sim_control.effects("acme", "k1") == 1


@pytest.mark.usefixtures("order")
def test_the_stripe_mode_ignores_the_deadline_as_stripe_does(
    simulator: SimulatorHandle, sim_tenant: SimTenant, sim_control: SimulatorControl
) -> None:
    headers = {
        "Authorization": f"Bearer {sim_tenant.api_key.get_secret_value()}",
        "Idempotency-Key": "k1",
        wire.DEADLINE: "2000-01-01T00:00:00.000Z",
    }
    form = {"payment_intent": "A1", "amount": "100", "metadata[settled_op_id]": "op-1"}
    made = httpx.post(
        f"{simulator.url}/stripe/v1/refunds", data=form, headers=headers, trust_env=False
    )
    assert made.status_code == 200, made.text
    assert sim_control.effects("acme", "k1") == 1


@pytest.mark.usefixtures("order")
def test_a_submit_without_a_readable_deadline_is_not_fenced(client: Client) -> None:
    assert client.submit("k1", deadline="whenever").status_code == 200


def test_a_simulator_started_without_the_fence_keeps_it_off_across_resets(
    tmp_path: Path,
) -> None:
    with (
        start_in_thread(ledger=str(tmp_path / "l.sqlite3"), deadline_fence=False) as handle,
        SimulatorControl(handle.url) as control,
    ):
        assert control.switches() == Switches(deadline_fence=False)
        control.set_switches(deadline_fence=True)
        control.reset()
        assert control.switches().deadline_fence is False


@pytest.mark.parametrize(
    "body",
    [
        {"lookups": False},
        {"idempotency": "no"},
        {"lookup_visibility_delay": -1},
        {"deadline_fence": "off"},
    ],
    ids=["unknown-name", "not-bool", "negative", "fence-not-bool"],
)
def test_bad_switch_is_refused_and_changes_nothing(
    simulator: SimulatorHandle, sim_control: SimulatorControl, body: dict[str, Any]
) -> None:
    response = httpx.post(f"{simulator.url}/_control/switches", json=body, trust_env=False)
    assert response.status_code == 400
    assert sim_control.switches() == Switches()


# -- authentication -------------------------------------------------------------------------


@pytest.mark.usefixtures("order")
@pytest.mark.parametrize("api_key", ["sk_test_wrong", ""])
def test_wrong_or_missing_api_key_is_401_and_executes_nothing(
    client: Client, sim_control: SimulatorControl, api_key: str
) -> None:
    headers = {"Idempotency-Key": "k1"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    response = client.http.post("/v1/refunds", json=REFUND, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == wire.AUTHENTICATION_ERROR
    assert client.lookup("k1", api_key="sk_test_wrong").status_code == 401
    assert sim_control.ledger()["effects"] == []


# -- the commerce rules ---------------------------------------------------------------------


@pytest.mark.usefixtures("order")
def test_refund_beyond_the_refundable_amount_is_a_business_refusal_saved_for_the_key(
    client: Client, sim_control: SimulatorControl
) -> None:
    assert client.submit("k1", {**REFUND, "amount_minor": 6000}).status_code == 200
    too_much = client.submit("k2", {**REFUND, "amount_minor": 4001})
    assert too_much.status_code == 402
    assert too_much.json()["error"] == {
        "type": wire.BUSINESS_ERROR,
        "code": "amount_exceeds_refundable",
        "message": "more than the refundable amount",
    }
    assert client.submit("k2", {**REFUND, "amount_minor": 4001}).headers[wire.REPLAYED] == "true"
    record = client.lookup("k2").json()
    assert record["status"] == "rejected"
    assert record["error"]["code"] == "amount_exceeds_refundable"
    assert client.submit("k3", {**REFUND, "amount_minor": 4000}).status_code == 200
    assert sim_control.refunded("acme", "A1") == 10000


@pytest.mark.parametrize(
    ("setup", "params", "code"),
    [
        ("closed", REFUND, "order_closed"),
        ("none", REFUND, "order_not_found"),
        ("open", {**REFUND, "currency": "USD"}, "currency_mismatch"),
    ],
)
def test_refund_on_a_closed_unknown_or_other_currency_order_is_refused(
    client: Client,
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    setup: str,
    params: Mapping[str, Any],
    code: str,
) -> None:
    if setup != "none":
        sim_control.create_order(sim_tenant.name, "A1", 10000, "CNY", closed=setup == "closed")
    response = client.submit("k1", params)
    assert response.status_code == 402
    assert error_code(response) == code
    assert sim_control.ledger()["effects"] == []


@pytest.mark.usefixtures("order")
def test_ticket_pickup_and_cancellation_follow_the_ticket_lifecycle(
    client: Client, sim_control: SimulatorControl
) -> None:
    pickup = {"ticket_id": "T1", "day": "2026-03-02", "slot": "morning"}
    cancel = {"ticket_id": "T1", "reason": "customer_request"}
    assert error_code(client.submit("p0", pickup, "/v1/pickups")) == "ticket_not_found"
    ticket = {"ticket_id": "T1", "order_id": "A1", "reason": "damaged"}
    assert client.submit("t1", ticket, "/v1/tickets").status_code == 200
    assert error_code(client.submit("t2", ticket, "/v1/tickets")) == "ticket_exists"
    assert client.submit("p1", pickup, "/v1/pickups").status_code == 200
    assert error_code(client.submit("p2", pickup, "/v1/pickups")) == "pickup_exists"
    assert client.submit("c1", cancel, "/v1/ticket_cancellations").status_code == 200
    assert error_code(client.submit("c2", cancel, "/v1/ticket_cancellations")) == "ticket_not_open"
    (row,) = sim_control.ledger()["tickets"]
    assert row == {
        "tenant": "acme",
        "ticket_id": "T1",
        "order_id": "A1",
        "status": "cancelled",
        "pickup": "2026-03-02 morning",
    }
    orphan = {"ticket_id": "T9", "order_id": "NOPE", "reason": "other"}
    assert error_code(client.submit("t9", orphan, "/v1/tickets")) == "order_not_found"


# -- faults ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("order")
def test_rule_fires_only_its_times_and_only_for_its_kind_and_tenant(
    client: Client, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule(Fault.UNAVAILABLE_BEFORE, "k-*", times=2, kind="refund", tenant="acme")
    sim_control.add_rule(Fault.UNAVAILABLE_BEFORE, "*", kind="pickup")
    small = {**REFUND, "amount_minor": 100}
    statuses = [client.submit(f"k-{i}", small).status_code for i in range(3)]
    assert statuses == [503, 503, 200]
    assert client.submit("other", small).status_code == 200
    assert sim_control.faults()["rules"][0]["left"] == 0


def _statuses_under_schedule(client: Client, keys: list[str]) -> dict[str, int]:
    return {key: client.submit(key, {**REFUND, "amount_minor": 1}).status_code for key in keys}


def test_schedule_draws_the_same_faults_per_key_whatever_the_arrival_order(
    client: Client, sim_control: SimulatorControl, sim_tenant: SimTenant
) -> None:
    keys = [f"k{i}" for i in range(24)]
    schedule = {Fault.UNAVAILABLE_BEFORE: 0.5}
    sim_control.create_order(sim_tenant.name, "A1", 10**6, "CNY")
    sim_control.set_schedule(seed=7, probabilities=schedule)
    forward = _statuses_under_schedule(client, keys)
    sim_control.reset()
    sim_control.add_tenant(sim_tenant.name, sim_tenant.api_key.get_secret_value())
    sim_control.create_order(sim_tenant.name, "A1", 10**6, "CNY")
    sim_control.set_schedule(seed=7, probabilities=schedule)
    backward = _statuses_under_schedule(client, list(reversed(keys)))
    assert forward == backward
    assert set(forward.values()) == {200, 503}
    expected = {
        key: 503 if Schedule(7, schedule).draw("submit", "acme", "refund", key, 1) else 200
        for key in keys
    }
    assert forward == expected


@pytest.mark.usefixtures("order")
def test_lookup_unavailable_fault_answers_503(
    client: Client, sim_control: SimulatorControl
) -> None:
    client.submit("k1")
    sim_control.add_rule(Fault.LOOKUP_UNAVAILABLE, "k1", times=1)
    assert client.lookup("k1").status_code == 503
    assert client.lookup("k1").status_code == 200


def test_faults_are_counted_by_kind_when_they_act_and_reset_clears_the_counts(
    client: Client, sim_control: SimulatorControl, sim_tenant: SimTenant
) -> None:
    sim_control.create_order(sim_tenant.name, "A1", 10**6, "CNY")
    small = {**REFUND, "amount_minor": 1}
    assert sim_control.injected() == {}
    sim_control.add_rule(Fault.RATE_LIMITED, "k1", times=2)
    sim_control.add_rule(Fault.UNAVAILABLE_BEFORE, "k2", times=1)
    sim_control.add_rule(Fault.UNAVAILABLE_AFTER_COMMIT, "k3", times=2)
    sim_control.add_rule(Fault.COMMIT_THEN_RESET, "k4", times=2)
    sim_control.add_rule(Fault.LOOKUP_UNAVAILABLE, "k3", times=1)
    assert [client.submit("k1", small).status_code for _ in range(3)] == [429, 429, 200]
    assert [client.submit("k2", small).status_code for _ in range(2)] == [503, 200]
    # The second 503_after_commit is drawn for a replay: the saved answer goes out as it
    # was, the fault acts on nothing and is not counted.
    assert [client.submit("k3", small).status_code for _ in range(2)] == [503, 503]
    for _ in range(2):  # a reset acts on a replay too
        with pytest.raises(httpx.TransportError):
            client.submit("k4", small)
    assert client.lookup("k3").status_code == 503
    assert client.lookup("k3").status_code == 200
    assert sim_control.injected() == {
        "429": 2,
        "503_after_commit": 1,
        "503_before": 1,
        "commit_then_reset": 2,
        "lookup_unavailable": 1,
    }
    assert sim_control.faults()["injected"] == sim_control.injected()
    sim_control.clear_rules()  # the counts are of what happened: clearing rules keeps them
    assert sum(sim_control.injected().values()) == 7
    sim_control.reset()
    assert sim_control.injected() == {}


def test_bad_rule_is_refused(sim_control: SimulatorControl) -> None:
    with pytest.raises(ValueError, match="no_such_fault"):
        sim_control.add_rule("no_such_fault")
    with pytest.raises(httpx.HTTPStatusError):
        sim_control.add_rule(Fault.RESET_BEFORE, times=0)


# -- control API, durability ----------------------------------------------------------------


def test_control_api_is_not_served_outside_test_mode(tmp_path: Path) -> None:
    ledger = str(tmp_path / "prod.sqlite3")
    with (
        start_in_thread(ledger=ledger, test_mode=False, tenants={"acme": "sk_1"}) as handle,
        httpx.Client(base_url=handle.url, trust_env=False) as http,
    ):
        for method, route in [("GET", "ledger"), ("POST", "reset"), ("POST", "rules")]:
            response = http.request(method, f"/_control/{route}", json={})
            assert response.status_code == 404
        lookup = http.get("/v1/lookup/k1", headers={"Authorization": "Bearer sk_1"})
        assert error_code(lookup) == wire.KEY_NOT_FOUND


def test_ledger_and_saved_results_survive_a_restart(tmp_path: Path) -> None:
    ledger = str(tmp_path / "ledger.sqlite3")
    with start_in_thread(ledger=ledger, tenants={"acme": "sk_1"}) as first:
        with SimulatorControl(first.url) as control:
            control.create_order("acme", "A1", 10000)
        before = Client(first.url, "sk_1")
        receipt = before.submit("k1").json()
        before.http.close()
    with start_in_thread(ledger=ledger) as second:
        after = Client(second.url, "sk_1")
        replay = after.submit("k1")
        after.http.close()
        assert replay.headers[wire.REPLAYED] == "true"
        assert replay.json() == receipt
        with SimulatorControl(second.url) as control:
            assert control.effects("acme", "k1") == 1


@pytest.mark.usefixtures("order")
def test_ledger_records_the_deadline_each_request_carried(
    client: Client, sim_control: SimulatorControl
) -> None:
    client.submit("k1")
    assert sim_control.requests("acme", "k1") == 1
    (row,) = sim_control.ledger()["requests"]
    assert row["last_deadline"] == "2030-01-01T00:00:00.000Z"


# -- connections: HTTP/1.1 keep-alive -------------------------------------------------------


def _refund(
    conn: http.client.HTTPConnection, key: str, api_key: str, params: Mapping[str, Any] = REFUND
) -> http.client.HTTPResponse:
    """One refund on ``conn``, its answer read (http.client keeps the socket if it may)."""
    headers = {
        "Authorization": f"Bearer {api_key}",
        "Idempotency-Key": key,
        "Content-Type": "application/json",
    }
    conn.request("POST", "/v1/refunds", body=json.dumps(dict(params)), headers=headers)
    response = conn.getresponse()
    response.read()
    return response


@pytest.fixture
def raw(simulator: SimulatorHandle) -> Iterator[Callable[[], http.client.HTTPConnection]]:
    """Plain ``http.client`` connections to the simulator (to see which socket carries what)."""
    opened: list[http.client.HTTPConnection] = []

    def connect() -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(simulator.host, simulator.port, timeout=5)
        opened.append(conn)
        return conn

    yield connect
    for conn in opened:
        conn.close()


@pytest.mark.usefixtures("order")
def test_one_connection_carries_request_after_request(
    raw: Callable[[], http.client.HTTPConnection],
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
) -> None:
    conn = raw()
    api_key = sim_tenant.api_key.get_secret_value()
    small = {**REFUND, "amount_minor": 100}
    sockets = set()
    for i in range(4):
        response = _refund(conn, f"k{i}", api_key, small)
        assert response.status == 200
        assert not response.will_close
        sockets.add(conn.sock)
    assert len(sockets) == 1  # never reconnected: one socket carried all four
    assert [sim_control.effects("acme", f"k{i}") for i in range(4)] == [1, 1, 1, 1]
    assert sim_control.refunded("acme", "A1") == 400


@pytest.mark.usefixtures("order")
@pytest.mark.parametrize(
    ("fault", "effects"), [(Fault.COMMIT_THEN_RESET, 1), (Fault.RESET_BEFORE, 0)]
)
def test_reset_on_a_kept_alive_connection_hits_only_the_request_in_flight(
    raw: Callable[[], http.client.HTTPConnection],
    sim_control: SimulatorControl,
    sim_tenant: SimTenant,
    fault: Fault,
    effects: int,
) -> None:
    api_key = sim_tenant.api_key.get_secret_value()
    small = {**REFUND, "amount_minor": 100}
    one, other = raw(), raw()
    assert _refund(one, "a1", api_key, small).status == 200
    assert _refund(other, "b1", api_key, small).status == 200
    other_socket = other.sock
    sim_control.add_rule(fault, "a2", times=1)
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        _refund(one, "a2", api_key, small)
    one.close()
    # The other connection, open all along, is untouched; the next request on a new one works.
    assert _refund(other, "b2", api_key, small).status == 200
    assert other.sock is other_socket
    assert _refund(one, "a3", api_key, small).status == 200
    counts = {key: sim_control.effects("acme", key) for key in ("a1", "a2", "a3", "b1", "b2")}
    assert counts == {"a1": 1, "a2": effects, "a3": 1, "b1": 1, "b2": 1}
    requests = {key: sim_control.requests("acme", key) for key in ("a1", "a2", "a3", "b1", "b2")}
    assert requests == dict.fromkeys(requests, 1)  # the reset hit a2 once, nothing was re-sent


def test_stop_returns_at_once_with_idle_kept_alive_connections(tmp_path: Path) -> None:
    # An idle timeout far longer than the test may run: stop() must not wait for it.
    handle = start_in_thread(
        ledger=str(tmp_path / "ledger.sqlite3"), tenants={"acme": "sk_1"}, idle_timeout=3600
    )
    conns = [http.client.HTTPConnection(handle.host, handle.port, timeout=5) for _ in range(3)]
    stopper = threading.Thread(target=handle.stop, daemon=True)
    try:
        for conn in conns:
            conn.request("GET", "/v1/lookup/k1", headers={"Authorization": "Bearer sk_1"})
            response = conn.getresponse()
            response.read()
            assert response.status == 404
            assert not response.will_close
        assert handle.open_connections() == 3
        stopper.start()
        stopper.join(timeout=60)  # a hang guard only: stop() returns at once
        assert not stopper.is_alive(), "stop() waited for idle keep-alive connections"
        for conn in conns:
            assert conn.sock is not None
            assert conn.sock.recv(1) == b""  # the server closed its end
    finally:
        for conn in conns:
            conn.close()
        if not stopper.is_alive() and stopper.ident is None:
            handle.stop()  # the test failed before stopping


@pytest.mark.usefixtures("order")
def test_header_names_are_case_insensitive(
    simulator: SimulatorHandle, sim_control: SimulatorControl, sim_tenant: SimTenant
) -> None:
    body = json.dumps(REFUND).encode()
    head = (
        "POST /v1/refunds HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {sim_tenant.api_key.get_secret_value()}\r\n"
        "IDEMPOTENCY-KEY: k1\r\nsettled-deadline: 2030-01-01T00:00:00.000Z\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    status, headers, answer = _exchange(simulator, head.encode() + body)
    assert status == 200
    assert "connection" not in headers  # HTTP/1.1: the connection stays open
    assert json.loads(answer)["idempotency_key"] == "k1"
    assert sim_control.requests("acme", "k1") == 1
    (row,) = sim_control.ledger()["requests"]
    assert row["last_deadline"] == "2030-01-01T00:00:00.000Z"


@pytest.mark.parametrize(
    ("request_head", "status"),
    [
        (b"POST /v1/refunds HTTP/1.1\r\nContent-Length: nope\r\n\r\n", 400),
        (b"POST /v1/refunds HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
        (b"POST /v1/refunds HTTP/1.1\r\nContent-Length: 999999\r\n\r\n", 413),
        (b"GARBAGE\r\n\r\n", 400),
        (b'GET /v1/"lookup HTTP/1.1 extra"\r\n\r\n', 400),
        (b"PUT /v1/refunds HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 501),
        (b'FOO"BAR /v1/refunds HTTP/1.1\r\nContent-Length: 0\r\n\r\n', 501),
        (b"FOO\\BAR</script> / HTTP/1.1\r\n\r\n", 501),
        (b"GET /" + b"x" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
        (b'GET / HTTP/1.1\r\nBad"Header\r\n\r\n', 400),
        (b"GET / HTTP/1.1\r\nX: " + b"y" * 70000 + b"\r\n\r\n", 431),
        (b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 101 + b"\r\n", 431),
    ],
    ids=[
        "bad-length", "chunked", "too-large", "bad-request-line", "quoted-request-line", "method",
        "quoted-method", "backslash-method", "long-line", "bad-header", "long-header",
        "many-headers",
    ],
)  # fmt: skip
def test_a_request_the_server_cannot_frame_is_answered_and_ends_the_connection(
    simulator: SimulatorHandle, request_head: bytes, status: int
) -> None:
    answered, headers, body = _exchange(simulator, request_head)
    assert answered == status
    assert headers["connection"] == "close"
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]  # valid JSON, whatever the request held
    assert error["type"] == wire.INVALID_REQUEST
    assert isinstance(error["code"], str) and isinstance(error["message"], str)
    assert b"FOO" not in body and b"script" not in body  # the request is never echoed


def _exchange(simulator: SimulatorHandle, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes on a fresh connection; read the answer until the server closes or it
    is complete (by Content-Length)."""
    with socket.create_connection((simulator.host, simulator.port), timeout=5) as sock:
        sock.sendall(data)
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection without an answer"
            received += chunk
        head, _, body = received.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in lines)
        }
        while len(body) < int(headers.get("content-length", 0)):
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
        return int(status_line.split()[1]), headers, body


# -- tenants and the idempotency lock -------------------------------------------------------


@pytest.mark.usefixtures("order")
def test_rekeying_or_resetting_a_tenant_takes_effect_for_the_next_request(
    client: Client, sim_control: SimulatorControl
) -> None:
    assert client.submit("k1").status_code == 200
    sim_control.add_tenant("acme", "sk_test_acme_rotated")
    assert client.submit("k2").status_code == 401
    assert client.submit("k2", api_key="sk_test_acme_rotated").status_code == 200
    sim_control.reset()
    assert client.submit("k3", api_key="sk_test_acme_rotated").status_code == 401


@pytest.mark.usefixtures("order")
def test_simultaneous_requests_with_one_key_execute_it_once(
    simulator: SimulatorHandle, sim_control: SimulatorControl, sim_tenant: SimTenant
) -> None:
    sim_control.create_order(sim_tenant.name, "A1", 10**6, "CNY")
    threads = 12
    start = threading.Barrier(threads)
    statuses: list[int] = []

    def send() -> None:
        with Client(simulator.url, sim_tenant.api_key.get_secret_value()) as c:
            start.wait()
            statuses.append(c.submit("k1").status_code)

    workers = [threading.Thread(target=send) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(statuses) == threads
    assert set(statuses) <= {200, 409}
    assert 200 in statuses
    assert sim_control.effects("acme", "k1") == 1
    assert sim_control.refunded("acme", "A1") == 4000
    assert sim_control.requests("acme", "k1") == threads


# -- the ledger on PostgreSQL ---------------------------------------------------------------


@pytest.mark.postgres
def test_ledger_on_postgresql_executes_replays_and_survives_a_restart(pg_server: str) -> None:
    name = f"settled_sim_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with services.throwaway_database(pg_server, name) as url:
        with start_in_thread(ledger=url, tenants={"acme": "sk_1"}) as first:
            with SimulatorControl(first.url) as control:
                control.create_order("acme", "A1", 10000)
                with Client(first.url, "sk_1") as c:
                    receipt = c.submit("k1").json()
                    assert c.submit("k2", {**REFUND, "amount_minor": 6001}).status_code == 402
                ledger = control.ledger()
            assert [e["idempotency_key"] for e in ledger["effects"]] == ["k1"]
            assert ledger["orders"][0]["refunded_minor"] == 4000
        with start_in_thread(ledger=url) as second, Client(second.url, "sk_1") as c:
            replay = c.submit("k1")
            assert replay.headers[wire.REPLAYED] == "true"
            assert replay.json() == receipt
            assert c.lookup("k2").json()["error"]["code"] == "amount_exceeds_refundable"
