"""The simulator's Stripe mode as strict as Stripe, and the Stripe gateway against it: each
place where the mode once differed from Stripe's documented behaviour, probed on the wire
(headers, API versions, unknown parameters, metadata limits, refunds by charge and by id, the
payment intent, a 404 for an unknown intent, refunds made ``pending``, ``requires_action``,
``failed`` or ``canceled``, 500s saved with and without a refund, a slow body), then what
Settled makes of it (the currency checked before a refund is sent, a 404 read as "not found",
Stripe's ``Request-Id`` on the attempt and the review item, the status code of a success)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from outbox.downstream import DownstreamRequest, LookupNotFound
from outbox.kinds import default_registry
from outbox.models import OperationEvent
from settled.simulator import SimulatorControl, SimulatorHandle
from tests.integration.test_review import in_review
from tests.support.rig import GOOD, HOLD, Rig
from tests.support.simtools import SimTenant
from workers.stripe_gateway import API_VERSION, StripeGateway

FORM = {
    "payment_intent": "pi_1",
    "amount": "2500",
    "metadata[settled_idempotency_key]": "k-1",
    "metadata[payee]": "P-7",
}
REFUND = default_registry().get("refund")


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


# -- headers ------------------------------------------------------------------------------


def test_every_answer_carries_a_request_id_the_version_and_the_key(
    stripe_api: httpx.Client,
) -> None:
    first = _refund(stripe_api)
    assert first.headers["Request-Id"].startswith("req_")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}(\.[a-z]+)?", first.headers["Stripe-Version"])
    assert first.headers["Idempotency-Key"] == "k-1"
    assert "Original-Request" not in first.headers
    listed = stripe_api.get(
        "/v1/refunds", params={"payment_intent": "pi_1"}, headers={"Stripe-Version": API_VERSION}
    )
    assert listed.headers["Request-Id"].startswith("req_")
    assert listed.headers["Request-Id"] != first.headers["Request-Id"]
    assert listed.headers["Stripe-Version"] == API_VERSION  # the request's, echoed
    assert "Idempotency-Key" not in listed.headers


def test_a_replay_names_the_original_request(stripe_api: httpx.Client) -> None:
    first = _refund(stripe_api)
    again = _refund(stripe_api)
    third = _refund(stripe_api)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Original-Request"] == first.headers["Request-Id"]
    assert third.headers["Original-Request"] == first.headers["Request-Id"]
    assert again.headers["Request-Id"] not in (
        first.headers["Request-Id"],
        third.headers["Request-Id"],
    )


@pytest.mark.parametrize("version", ["2020-13-45", "yesterday", "2024-06-20.", "2024-06-20.A"])
def test_an_invalid_api_version_is_refused_and_nothing_is_done(
    stripe_api: httpx.Client, sim_control: SimulatorControl, version: str
) -> None:
    answer = stripe_api.post(
        "/v1/refunds", data=FORM, headers={"Idempotency-Key": "k-1", "Stripe-Version": version}
    )
    assert answer.status_code == 400 and _error(answer)["type"] == "invalid_request_error"
    assert "API version" in _error(answer)["message"]
    assert sim_control.effects("acme", "k-1") == 0
    assert _refund(stripe_api).status_code == 200  # nothing was saved for the key


# -- parameters -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["amout", "metadata", "payment_intent[x]", "expand_all"])
def test_an_unknown_parameter_is_parameter_unknown_and_nothing_is_done(
    stripe_api: httpx.Client, sim_control: SimulatorControl, name: str
) -> None:
    answer = _refund(stripe_api, **{name: "1"})
    error = _error(answer)
    assert (answer.status_code, error["code"], error["param"]) == (400, "parameter_unknown", name)
    assert sim_control.effects("acme", "k-1") == 0


def test_an_unknown_list_parameter_is_parameter_unknown(stripe_api: httpx.Client) -> None:
    answer = stripe_api.get("/v1/refunds", params={"payment_intent": "pi_1", "order": "x"})
    assert answer.status_code == 400 and _error(answer)["code"] == "parameter_unknown"


@pytest.mark.parametrize(
    ("name", "value", "ok"),
    [
        ("note", "x" * 500, True),
        ("note", "x" * 501, False),
        ("k" * 40, "v", True),
        ("k" * 41, "v", False),
    ],
    ids=["value_500", "value_501", "key_40", "key_41"],
)
def test_metadata_past_stripes_limits_is_refused(
    stripe_api: httpx.Client, sim_control: SimulatorControl, name: str, value: str, ok: bool
) -> None:
    answer = _refund(stripe_api, **{f"metadata[{name}]": value})
    if ok:
        assert answer.status_code == 200 and answer.json()["metadata"][name] == value
        return
    error = _error(answer)
    assert (answer.status_code, error["type"]) == (400, "invalid_request_error")
    assert error["param"] == f"metadata[{name}]"
    assert sim_control.effects("acme", "k-1") == 0


def test_more_than_fifty_metadata_keys_are_refused(stripe_api: httpx.Client) -> None:
    many = {f"metadata[m{i}]": "v" for i in range(49)}  # with the form's two: 51
    answer = _refund(stripe_api, **many)
    assert answer.status_code == 400 and _error(answer)["param"] == "metadata"


# -- what can be read -----------------------------------------------------------------------


def test_an_unknown_payment_intents_refunds_are_404_resource_missing(
    stripe_api: httpx.Client,
) -> None:
    answer = stripe_api.get("/v1/refunds", params={"payment_intent": "pi_nobody"})
    error = _error(answer)
    assert (answer.status_code, error["code"], error["param"]) == (
        404,
        "resource_missing",
        "payment_intent",
    )
    known = stripe_api.get("/v1/refunds", params={"payment_intent": "pi_1"})
    assert known.status_code == 200 and known.json()["data"] == []  # known, no refund yet


def test_a_refund_by_charge_is_made_on_its_payment_intent_and_listed_by_it(
    stripe_api: httpx.Client, sim_control: SimulatorControl
) -> None:
    by_charge = {k: v for k, v in FORM.items() if k != "payment_intent"}
    made = stripe_api.post(
        "/v1/refunds", data={**by_charge, "charge": "ch_1"}, headers={"Idempotency-Key": "k-1"}
    )
    assert made.status_code == 200, made.text
    body = made.json()
    assert (body["payment_intent"], body["charge"]) == ("pi_1", "ch_1")
    assert sim_control.refunded("acme", "pi_1") == 2500
    listed = stripe_api.get("/v1/refunds", params={"charge": "ch_1"}).json()
    assert [r["id"] for r in listed["data"]] == [body["id"]]
    missing = stripe_api.get("/v1/refunds", params={"charge": "ch_nobody"})
    assert missing.status_code == 404 and _error(missing)["param"] == "charge"
    other = stripe_api.post(
        "/v1/refunds", data={**by_charge, "charge": "ch_nobody"}, headers={"Idempotency-Key": "k-2"}
    )
    assert other.status_code == 404 and _error(other)["code"] == "resource_missing"


def test_a_refund_is_read_by_its_id(stripe_api: httpx.Client) -> None:
    made = _refund(stripe_api).json()
    read = stripe_api.get(f"/v1/refunds/{made['id']}")
    assert read.status_code == 200 and read.json() == made
    missing = stripe_api.get("/v1/refunds/re_nobody")
    assert missing.status_code == 404 and _error(missing)["code"] == "resource_missing"


def test_the_payment_intent_is_read_with_its_currency(stripe_api: httpx.Client) -> None:
    intent = stripe_api.get("/v1/payment_intents/pi_1")
    assert intent.status_code == 200
    body = intent.json()
    assert (body["object"], body["currency"], body["amount"]) == ("payment_intent", "eur", 10000)
    assert body["latest_charge"] == "ch_1"
    missing = stripe_api.get("/v1/payment_intents/pi_nobody")
    assert missing.status_code == 404 and _error(missing)["code"] == "resource_missing"


# -- refund statuses ------------------------------------------------------------------------


def test_a_pending_refund_is_answered_pending_then_read_as_stripe_moves_it(
    stripe_api: httpx.Client, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule("refund_status", times=1, code="pending")
    made = _refund(stripe_api)
    assert made.status_code == 200 and made.json()["status"] == "pending"
    refund_id = made.json()["id"]
    assert sim_control.effects("acme", "k-1") == 1  # Stripe made a refund object
    listed = stripe_api.get("/v1/refunds", params={"payment_intent": "pi_1"}).json()
    assert [r["status"] for r in listed["data"]] == ["pending"]
    sim_control.move_stripe_refund("acme", "k-1", "succeeded")
    assert stripe_api.get(f"/v1/refunds/{refund_id}").json()["status"] == "succeeded"
    replayed = _refund(stripe_api)
    assert replayed.json()["status"] == "pending"  # the saved answer, as it was
    assert sim_control.effects("acme", "k-1") == 1


@pytest.mark.parametrize(
    ("made_as", "moves", "status", "reason"),
    [
        ("failed", [], "failed", "declined"),
        ("pending", [("failed", "insufficient_funds")], "failed", "insufficient_funds"),
        ("requires_action", [("canceled", None)], "canceled", None),
        ("requires_action", [("pending", None), ("succeeded", None)], "succeeded", None),
    ],
    ids=["failed_at_once", "pending_then_failed", "requires_action_canceled", "action_taken"],
)
def test_each_refund_status_stripe_documents_can_be_produced(
    stripe_api: httpx.Client,
    sim_control: SimulatorControl,
    made_as: str,
    moves: list[tuple[str, str | None]],
    status: str,
    reason: str | None,
) -> None:
    sim_control.add_rule("refund_status", times=1, code=made_as)
    made = _refund(stripe_api).json()
    assert made["status"] == made_as
    for to, why in moves:
        sim_control.move_stripe_refund("acme", "k-1", to, why)
    read = stripe_api.get(f"/v1/refunds/{made['id']}").json()
    assert (read["status"], read["failure_reason"]) == (status, reason)
    made_money = status == "succeeded"  # failed, canceled: the money went back
    assert sim_control.effects("acme", "k-1") == (1 if made_money else 0)
    assert sim_control.refunded("acme", "pi_1") == (2500 if made_money else 0)


def test_a_refund_may_move_only_where_stripe_moves_it(
    stripe_api: httpx.Client, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule("refund_status", times=1, code="pending")
    _refund(stripe_api)
    with pytest.raises(httpx.HTTPStatusError):
        sim_control.move_stripe_refund("acme", "k-1", "canceled")  # only requires_action
    _refund(stripe_api, key="k-2")  # succeeded: settled, it moves nowhere
    with pytest.raises(httpx.HTTPStatusError):
        sim_control.move_stripe_refund("acme", "k-2", "failed")
    assert sim_control.effects("acme", "k-2") == 1


# -- 500s -----------------------------------------------------------------------------------


def test_an_error_after_the_refund_was_made_is_stripes_500_saved_and_replayed(
    stripe_api: httpx.Client, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule("503_after_commit", times=1)
    first = _refund(stripe_api)
    assert first.status_code == 500 and _error(first)["type"] == "api_error"
    again = _refund(stripe_api)
    assert again.status_code == 500 and again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Original-Request"] == first.headers["Request-Id"]
    assert sim_control.effects("acme", "k-1") == 1


def test_a_500_saved_with_no_refund_is_replayed_and_nothing_is_listed(
    stripe_api: httpx.Client, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule("500_saved", times=1)
    first = _refund(stripe_api)
    assert first.status_code == 500 and _error(first)["type"] == "api_error"
    again = _refund(stripe_api)
    assert again.status_code == 500 and again.headers["Idempotent-Replayed"] == "true"
    assert sim_control.effects("acme", "k-1") == 0
    listed = stripe_api.get("/v1/refunds", params={"payment_intent": "pi_1"}).json()
    assert listed["data"] == []


def test_a_slow_body_outlasts_a_clients_read_timeout_after_the_refund_was_made(
    simulator: SimulatorHandle, stripe_api: httpx.Client, sim_control: SimulatorControl
) -> None:
    sim_control.add_rule("slow_body", times=1, hold_seconds=0.5)
    with pytest.raises(httpx.ReadTimeout):
        stripe_api.post(
            "/v1/refunds",
            data=FORM,
            headers={"Idempotency-Key": "k-1"},
            timeout=httpx.Timeout(5.0, read=0.2),
        )
    assert sim_control.effects("acme", "k-1") == 1
    assert sim_control.injected().get("slow_body") == 1


# -- the gateway against it -----------------------------------------------------------------


def _gateway(rig: Rig) -> StripeGateway:
    gateway = rig.gateway()
    assert isinstance(gateway, StripeGateway)
    return gateway


def test_an_intent_in_another_currency_than_the_charge_is_refused_before_sending(
    stripe_rig: Rig,
) -> None:
    stripe_rig.control.create_order("acme", "pi_usd", 100000, currency="USD")
    op = stripe_rig.enqueue(params={**GOOD, "order_id": "pi_usd", "currency": "EUR"})
    stripe_rig.executor().execute([op])
    row = stripe_rig.op(op)
    assert (row.state, row.reason) == ("rejected", "invalid_params")
    (attempt,) = stripe_rig.attempts(op)
    assert attempt.detail is not None and attempt.detail["code"] == "currency_mismatch"
    assert stripe_rig.sends(op) == 0  # no refund was asked for
    assert stripe_rig.effects(op) == 0
    assert stripe_rig.control.refunded("acme", "pi_usd") == 0


def test_an_unknown_payment_intent_is_refused_before_sending(stripe_rig: Rig) -> None:
    op = stripe_rig.enqueue(params={**GOOD, "order_id": "pi_nobody"})
    stripe_rig.executor().execute([op])
    row = stripe_rig.op(op)
    assert (row.state, row.reason) == ("rejected", "invalid_params")
    assert stripe_rig.sends(op) == 0


def test_a_lookup_for_an_unknown_payment_intent_is_not_found_not_unavailable(
    stripe_rig: Rig,
) -> None:
    request = DownstreamRequest("acme", "op-1", REFUND, "stl_k", {**GOOD, "order_id": "pi_nobody"})
    looked = _gateway(stripe_rig).lookup(request, deadline=datetime.now(UTC) + timedelta(seconds=5))
    assert isinstance(looked, LookupNotFound), looked


def test_a_success_is_stored_with_its_status_code_and_stripes_request_id(
    stripe_rig: Rig,
) -> None:
    op = stripe_rig.enqueue()
    stripe_rig.executor().execute([op])
    assert stripe_rig.op(op).state == "succeeded"
    (attempt,) = stripe_rig.attempts(op)
    assert attempt.status_code == 200
    assert attempt.detail is not None and attempt.detail["request_id"].startswith("req_")


def test_a_refusal_keeps_stripes_request_id(stripe_rig: Rig) -> None:
    op = stripe_rig.enqueue(params={**GOOD, "amount_minor": 987654})
    stripe_rig.executor().execute([op])
    assert stripe_rig.op(op).state == "rejected"
    (attempt,) = stripe_rig.attempts(op)
    assert attempt.status_code == 400
    assert attempt.detail is not None and attempt.detail["request_id"].startswith("req_")


def test_a_review_item_points_support_to_stripes_request(stripe_rig: Rig) -> None:
    stripe_rig.control.add_rule("mismatched_receipt", times=1)
    op = stripe_rig.enqueue()
    stripe_rig.executor().execute([op])
    assert stripe_rig.op(op).state == "unknown"
    (item,) = stripe_rig.reviews(op)
    (attempt,) = stripe_rig.attempts(op)
    assert attempt.detail is not None
    assert item.evidence["request_id"] == attempt.detail["request_id"]
    assert item.evidence["request_id"].startswith("req_")


def test_a_pending_refund_stays_unknown_until_stripe_settles_it(stripe_rig: Rig) -> None:
    stripe_rig.control.add_rule("refund_status", times=1, code="pending")
    op = stripe_rig.enqueue()
    stripe_rig.executor().execute([op])
    assert stripe_rig.op(op).state == "unknown"  # taken on, not made
    assert stripe_rig.reconciler().run_once().outcomes == {"lookup_unavailable": 1}
    key = stripe_rig.op(op).idempotency_key
    stripe_rig.control.move_stripe_refund("acme", key, "succeeded")
    stripe_rig.make_due(op)
    assert stripe_rig.reconciler().run_once().outcomes == {"found": 1}
    assert stripe_rig.op(op).state == "succeeded"
    assert stripe_rig.sends(op) == 1 and stripe_rig.effects(op) == 1


@pytest.mark.parametrize("made_as", ["pending", "requires_action"])
def test_a_refund_stripe_fails_later_is_rejected_never_sent_again(
    stripe_rig: Rig, made_as: str
) -> None:
    stripe_rig.control.add_rule("refund_status", times=1, code=made_as)
    op = stripe_rig.enqueue()
    stripe_rig.executor().execute([op])
    assert stripe_rig.op(op).state == "unknown"
    key = stripe_rig.op(op).idempotency_key
    stripe_rig.control.move_stripe_refund("acme", key, "failed", "expired_or_canceled_card")
    stripe_rig.make_due(op)
    assert stripe_rig.reconciler().run_once().outcomes == {"found": 1}
    row = stripe_rig.op(op)
    assert (row.state, row.reason) == ("rejected", "business_rejected")
    assert stripe_rig.sends(op) == 1
    with stripe_rig.sessions() as s:
        last = s.scalars(
            select(OperationEvent.evidence)
            .where(OperationEvent.operation_id == op)
            .order_by(OperationEvent.id.desc())
        ).first()
    assert last is not None and last["code"] == "refund_failed:expired_or_canceled_card"


def test_a_refund_failed_at_once_is_rejected_with_its_reason(stripe_rig: Rig) -> None:
    stripe_rig.control.add_rule("refund_status", times=1, code="failed")
    op = stripe_rig.enqueue()
    stripe_rig.executor().execute([op])
    row = stripe_rig.op(op)
    assert (row.state, row.reason) == ("rejected", "business_rejected")
    (attempt,) = stripe_rig.attempts(op)
    assert attempt.detail is not None and attempt.detail["code"] == "refund_failed:declined"


def test_a_saved_500_with_no_refund_is_unknown_and_never_read_as_not_done(
    stripe_rig: Rig,
) -> None:
    stripe_rig.control.add_rule("500_saved", times=1)
    op = stripe_rig.enqueue()
    stripe_rig.executor().execute([op])
    assert stripe_rig.op(op).state == "unknown"  # a 500 proves nothing either way
    (attempt,) = stripe_rig.attempts(op)
    assert attempt.status_code == 500
    assert stripe_rig.effects(op) == 0


def test_a_slow_body_ends_at_the_deadline_as_unknown_with_the_refund_made(
    stripe_rig: Rig,
) -> None:
    stripe_rig.control.add_rule("slow_body", times=1, hold_seconds=HOLD)
    op = stripe_rig.enqueue()
    gateway = stripe_rig.gateway(timeout=1.0)
    request = DownstreamRequest.of(stripe_rig.op(op), REFUND)
    outcome = gateway.submit(request, deadline=datetime.now(UTC) + timedelta(seconds=1))
    assert outcome.proof.value == "unknown", outcome
    assert stripe_rig.effects(op) == 1


def test_a_success_over_the_wire_protocol_is_stored_with_its_status_code(rig: Rig) -> None:
    op = rig.enqueue()
    rig.executor().execute([op])
    assert rig.op(op).state == "succeeded"
    (attempt,) = rig.attempts(op)
    assert attempt.status_code == 200


def test_a_slow_body_over_the_wire_protocol_ends_at_the_deadline_as_unknown(rig: Rig) -> None:
    rig.control.add_rule("slow_body", times=1, hold_seconds=HOLD)
    op = rig.enqueue()
    gateway = rig.gateway(timeout=1.0)
    request = DownstreamRequest.of(rig.op(op), REFUND)
    outcome = gateway.submit(request, deadline=datetime.now(UTC) + timedelta(seconds=1))
    assert outcome.proof.value == "unknown", outcome
    assert rig.effects(op) == 1


def test_a_review_item_the_reconciler_opens_names_each_attempts_request(stripe_rig: Rig) -> None:
    op, _ = in_review(stripe_rig, "503_after_commit")
    (item,) = stripe_rig.reviews(op)
    (attempt,) = item.evidence["attempts"]
    assert attempt["status_code"] == 500
    assert attempt["detail"]["request_id"].startswith("req_")
