"""The executor's, the reconciler's and the review queue's guarantee tests, run again against the
simulator's Stripe mode through the Stripe gateway (the official SDK over ``api_base``): one
effect per key and truthful states, with the same faults and the same ledger as the wire
protocol's runs; what nobody can settle goes to review, and staff resolve it.

Each test here is an existing test, run on ``stripe_rig`` (a rig whose gateways speak Stripe),
so the guarantees are stated once and checked in both modes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from outbox import logs
from outbox.settings import Settings
from settled.console.auth import ConsoleUser, current_user, require_csrf
from settled.simulator import SimulatorControl, start_in_thread
from settled.simulator.stripe import PREFIX as STRIPE_PREFIX
from settled.web import create_web_app
from tests.integration import test_executor as executor_tests
from tests.integration import test_reconciler as reconciler_tests
from tests.integration import test_review as review_tests
from tests.integration import test_review_reasons as reason_tests
from tests.integration.test_console_pages import ANN, CSRF
from tests.integration.test_review import in_review
from tests.support.rig import GOOD, HOLD, Rig
from workers.stripe_gateway import LIST_LIMIT

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from fastapi.testclient import TestClient

GUARANTEES: list[Callable[[Rig], None]] = [
    executor_tests.test_happy_path_records_the_receipt,
    executor_tests.test_one_hint_delivered_five_times_sends_once,
    executor_tests.test_commit_then_timeout_marks_unknown_with_one_effect,
    executor_tests.test_commit_then_reset_marks_unknown,
    executor_tests.test_reset_before_processing_is_still_unknown_to_us,
    executor_tests.test_503_after_commit_is_unknown_under_the_default_contract,
    executor_tests.test_429_retry_after_inside_the_deadline_schedules_the_retry,
    executor_tests.test_business_refusal_is_rejected_with_reason,
    executor_tests.test_wrong_api_key_is_permission_denied_and_never_retried,
    executor_tests.test_403_permission_error_is_permission_denied_and_never_retried,
    executor_tests.test_mismatched_receipt_is_unknown_with_a_review_item,
    executor_tests.test_past_key_retention_nothing_is_sent,
    executor_tests.test_abandoned_send_is_queried_never_resent,
    reconciler_tests.test_commit_then_timeout_is_reconciled_to_succeeded_with_one_effect,
    reconciler_tests.test_lookup_unavailable_past_the_threshold_goes_to_review_and_stays_unknown,
    reconciler_tests.test_not_found_after_quiescence_is_sent_again_with_the_same_key,
    reconciler_tests.test_past_key_retention_nothing_is_sent_again,
    reconciler_tests.test_mismatched_lookup_stays_in_review,
    reconciler_tests.test_worker_died_mid_send_is_found_by_the_reconciler,
]


@pytest.mark.parametrize("guarantee", GUARANTEES, ids=lambda test: test.__name__[5:])
def test_guarantee_holds_in_stripe_mode(stripe_rig: Rig, guarantee: Callable[[Rig], None]) -> None:
    guarantee(stripe_rig)


@pytest.mark.parametrize("fault", ["commit_then_timeout", "reset_before"])
def test_unknown_from_either_side_of_the_commit_ends_succeeded_once(
    stripe_rig: Rig, fault: str
) -> None:
    reconciler_tests.test_unknown_from_either_side_of_the_commit_ends_succeeded_once(
        stripe_rig, fault
    )


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_lookup_pages_past_a_hundred_refunds_on_the_payment_intent(stripe_rig: Rig) -> None:
    stripe_rig.control.add_rule("commit_then_reset", times=1)  # done; the answer lost
    op = stripe_rig.enqueue()
    stripe_rig.executor().execute([op])
    assert stripe_rig.op(op).state == "unknown"
    others = LIST_LIMIT + 20  # newer than ours: it is on the second page, newest first
    key = stripe_rig.tenant.api_key.get_secret_value()
    with httpx.Client(
        base_url=stripe_rig.url + STRIPE_PREFIX, headers={"Authorization": f"Bearer {key}"}
    ) as api:
        for i in range(others):
            form = {"payment_intent": "A1042", "amount": "1", "metadata[settled_op_id]": f"x{i}"}
            made = api.post("/v1/refunds", data=form, headers={"Idempotency-Key": f"other-{i}"})
            assert made.status_code == 200, made.text
    assert stripe_rig.reconciler().run_once().outcomes == {"found": 1}
    row = stripe_rig.op(op)
    assert row.state == "succeeded" and row.lookups == 1
    assert stripe_rig.effects(op) == 1 and stripe_rig.sends(op) == 1
    # one lookup read two pages (each page is a lookup of every key on the intent)
    assert stripe_rig.control.requests("acme", row.idempotency_key, phase="lookup") == 2


#: The review queue's tests that ask the downstream (lookups behind staff's resolutions and
#: requeries, the CLI built from settings): an operation nobody can settle lands in review, a
#: mismatched receipt does too, and staff resolve them against the downstream's record.
REVIEWS: list[Callable[[Rig], None]] = [
    review_tests.test_resolve_as_succeeded_is_verified_by_lookup_and_recorded,
    review_tests.test_a_resolution_that_contradicts_the_lookup_is_refused,
    review_tests.test_rejected_needs_a_justification_and_not_found_evidence,
    review_tests.test_requery_settles_when_the_lookup_is_back,
    review_tests.test_review_cli_end_to_end,
    reason_tests.test_a_receipt_mismatch_is_stored_as_what_the_downstream_did,
]
#: Review reasons the Stripe gateway meets on the wire (the others are scripted outcomes,
#: whatever the gateway).
REASONS = [
    "receipt_mismatch",
    "past_key_retention",
    "no_lookup_replay_cannot_settle",
]


# Once, on PostgreSQL: the wire format is what differs here, not the database.
@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
@pytest.mark.parametrize("review", REVIEWS, ids=lambda test: test.__name__[5:])
def test_review_works_in_stripe_mode(stripe_rig: Rig, review: Callable[[Rig], None]) -> None:
    review(stripe_rig)


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
@pytest.mark.parametrize("reason", REASONS)
def test_review_reason_has_a_way_out_in_stripe_mode(stripe_rig: Rig, reason: str) -> None:
    reason_tests.way_out(stripe_rig, reason)


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_a_console_requery_of_a_refund_asks_stripe_not_the_wire_protocol_service(
    stripe_rig: Rig, tmp_path: Path
) -> None:
    """Refunds go to Stripe (``SETTLED_DOWNSTREAM_PROVIDERS``), other kinds to a wire-protocol
    service of their own (a second simulator, which never saw the refund). The console that
    ``settled web`` builds from these settings requeries a refund in review at Stripe: it finds
    the refund and settles the item. (Built with a plain wire-protocol gateway, it asked the
    other service, whose "not found" was taken as evidence.)"""
    op, item = in_review(stripe_rig)  # refunded at Stripe, the answer lost, the lookup down
    key = stripe_rig.op(op).idempotency_key
    api_key = stripe_rig.tenant.api_key.get_secret_value()
    wire = start_in_thread(ledger=str(tmp_path / "wire-protocol.sqlite3"), test_mode=True)
    try:
        with SimulatorControl(wire.url) as elsewhere:
            elsewhere.add_tenant("acme", api_key)
            settings = Settings(
                database_url=stripe_rig.engine.url.render_as_string(hide_password=False),
                development=True,
                downstream_url=wire.url,
                downstream_api_keys={"acme": api_key},
                downstream_providers={"refund": "stripe"},
                stripe_api_keys={"acme": api_key},
                stripe_api_base=stripe_rig.url + STRIPE_PREFIX,
            )
            app = create_web_app(settings)
            app.dependency_overrides[current_user] = lambda: ConsoleUser(ANN, CSRF)
            app.dependency_overrides[require_csrf] = lambda: None
            with TestClient(app) as client:
                r = client.post(f"/console/review/{item}/requery", data={"csrf_token": CSRF})
                assert r.status_code == 200
                assert "The lookup found it: the operation is now succeeded." in r.text, r.text
                app.state.console.review.gateway.close()
            assert stripe_rig.op(op).state == "succeeded"
            assert stripe_rig.reviews(op)[0].resolved_by == "staff:ann"
            assert elsewhere.requests("acme", key, phase="lookup") == 0
            assert elsewhere.ledger()["requests"] == []  # nothing at all asked of it
            assert stripe_rig.effects(op) == 1 and stripe_rig.sends(op) == 1
    finally:
        wire.stop()


@pytest.mark.usefixtures("settled_logging")
@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_no_order_amount_or_payee_reaches_the_log_in_stripe_mode(
    stripe_rig: Rig,
    level: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A refund, a refusal and a lost answer settled by a lookup through the Stripe SDK,
    with Settled's logging at ``level`` and the SDK's own console printing asked for
    (``STRIPE_LOG``): the SDK writes request URLs (the payment intent names the order),
    bodies (amount, payee) and the service's error messages; none of it may be heard."""
    from stripe import _util

    monkeypatch.setattr(_util, "STRIPE_LOG", level.lower())
    logs.configure(level, "json")
    capsys.readouterr()
    executor_tests.test_happy_path_records_the_receipt(stripe_rig)
    refused = stripe_rig.enqueue("op-refused", params={**GOOD, "amount_minor": 987654})
    stripe_rig.executor().execute([refused])
    assert stripe_rig.op(refused).state == "rejected"
    stripe_rig.control.add_rule("commit_then_timeout", times=1, hold_seconds=HOLD)
    lost = stripe_rig.enqueue("op-lost", params={**GOOD, "amount_minor": 4321})
    stripe_rig.executor().execute([lost])
    assert stripe_rig.op(lost).state == "unknown"
    assert stripe_rig.reconciler().run_once().outcomes == {"found": 1}
    written = capsys.readouterr()
    text = written.out + written.err
    assert '"logger": "workers.stripe_gateway"' in written.err  # the capture works
    for secret in ("A1042", "pi_A1042", "P-7", "10000", "100.00", "987654", "9876.54", "4321"):
        assert secret not in text, secret
