"""The executor's and the reconciler's guarantee tests, run again against the simulator's Stripe
mode through the Stripe gateway (the official SDK over ``api_base``): one effect per key and
truthful states, with the same faults and the same ledger as the wire protocol's runs.

Each test here is an existing test, run on ``stripe_rig`` (a rig whose gateways speak Stripe),
so the guarantees are stated once and checked in both modes.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from settled.simulator.stripe import PREFIX as STRIPE_PREFIX
from tests.integration import test_executor as executor_tests
from tests.integration import test_reconciler as reconciler_tests
from tests.support.rig import Rig
from workers.stripe_gateway import LIST_LIMIT

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


def test_lookup_pages_past_a_hundred_refunds_on_the_payment_intent(stripe_rig: Rig) -> None:
    op = reconciler_tests.lost_after_commit(stripe_rig)
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
